-- Views over the run ledger: the questions users ask, answered in SQL. Documented in docs/ledger.md.
-- now() in epoch seconds, portable to older SQLite: (julianday('now') - 2440587.5) * 86400.0

DROP VIEW IF EXISTS v_cells;
CREATE VIEW v_cells AS
SELECT c.id AS cell, CASE WHEN c.is_core THEN 'core' ELSE 'satellite' END AS kind, c.role, c.target_role, c.pinned,
       (SELECT count(*) FROM agents a WHERE a.cell_id = c.id AND a.status = 'UP') AS agents_up, c.n_nodes,
       round((julianday('now') - 2440587.5) * 86400.0 - c.last_heartbeat, 1) AS heartbeat_age_s,
       round((julianday('now') - 2440587.5) * 86400.0 - s.started_at, 1) AS in_role_s,
       c.slurm_job_id, c.slurm_state
FROM cells c LEFT JOIN cell_spans s ON s.cell_id = c.id AND s.ended_at IS NULL;

DROP VIEW IF EXISTS v_cell_role_time;
CREATE VIEW v_cell_role_time AS
SELECT cell_id AS cell, role, count(*) AS spans,
       round(sum(coalesce(ended_at, (julianday('now') - 2440587.5) * 86400.0) - started_at), 3) AS seconds
FROM cell_spans GROUP BY cell_id, role;

DROP VIEW IF EXISTS v_switch_durations;
CREATE VIEW v_switch_durations AS
SELECT id AS switch, cell_id AS cell, from_role, to_role, reason, status,
       datetime(requested_at, 'unixepoch') AS requested, round(duration_s, 3) AS duration_s,
       round(ended_at - started_at, 3) AS node_switch_s, error
FROM role_switches;

DROP VIEW IF EXISTS v_rollouts_by_status;
CREATE VIEW v_rollouts_by_status AS  -- training runs (evaluation runs: v_eval)
SELECT status, count(*) AS rollouts, round(avg(reward), 4) AS mean_reward,
       round(avg(ended_at - started_at), 2) AS mean_duration_s,
       sum(prompt_tokens) AS prompt_tokens, sum(completion_tokens) AS completion_tokens
FROM rollouts WHERE kind = 'train' GROUP BY status;

DROP VIEW IF EXISTS v_step_times;
CREATE VIEW v_step_times AS
SELECT step, policy, status, version_in, version_out, datetime(started_at, 'unixepoch') AS started,
       round(ended_at - started_at, 3) AS step_s, round(rollout_s, 3) AS rollout_s, round(train_s, 3) AS train_s,
       n_groups, n_runs, n_cells, tokens_trained, reward_mean, loss,
       round(ended_at - lag(ended_at) OVER (ORDER BY step), 3) AS since_prev_step_s
FROM train_steps;

DROP VIEW IF EXISTS v_reward_per_step;
CREATE VIEW v_reward_per_step AS
SELECT step, reward_mean, n_runs, tokens_trained, loss FROM train_steps WHERE status = 'DONE';

DROP VIEW IF EXISTS v_tokens_per_step;
CREATE VIEW v_tokens_per_step AS
SELECT t.step, t.tokens_trained,
       (SELECT coalesce(sum(r.completion_tokens), 0) FROM rollouts r JOIN groups g ON g.id = r.group_id
        WHERE g.train_step = t.step) AS tokens_generated
FROM train_steps t;

DROP VIEW IF EXISTS v_events;
CREATE VIEW v_events AS
SELECT id, datetime(ts, 'unixepoch') AS time, kind, severity, cell_id AS cell, node_index AS node, message
FROM events;

DROP VIEW IF EXISTS v_rollout_trees;
CREATE VIEW v_rollout_trees AS  -- one row per (rollout, parent) first: a non-null parent is a node with children
SELECT p.rollout_id AS rollout, r.status, r.reward, r.n_calls AS calls, sum(p.n) AS nodes,
       sum(p.n) - sum(p.parent_key IS NOT NULL) AS paths, sum(CASE WHEN p.parent_key IS NULL THEN p.n END) AS roots,
       sum(p.parent_key IS NOT NULL AND p.n > 1) AS branch_points, sum(p.tokens) AS tokens,
       sum(p.trainable) AS trainable,
       (SELECT group_concat(DISTINCT k.kind) FROM tree_nodes k WHERE k.rollout_id = p.rollout_id) AS kinds
FROM (SELECT rollout_id, parent_key, count(*) AS n, sum(n_tokens) AS tokens, sum(n_trainable) AS trainable
      FROM tree_nodes GROUP BY rollout_id, parent_key) p
JOIN rollouts r ON r.id = p.rollout_id
GROUP BY p.rollout_id;

DROP VIEW IF EXISTS v_policy_decisions;
CREATE VIEW v_policy_decisions AS  -- what the scheduler decided, why, and the numbers it saw (W against |R|·k)
SELECT id, datetime(ts, 'unixepoch') AS time, ts AS ts_epoch,
       round(ts - (SELECT min(ts) FROM policy_decisions), 3) AS t_s, policy, kind,
       CASE WHEN kind = 'switch' THEN role || ' ' || cells
            WHEN kind = 'train' THEN groups || ' groups on ' || cells
            WHEN kind = 'admit' THEN groups || ' groups' ELSE '' END AS what,
       watermark AS w, capacity, queued, running, groups_ready AS ready, groups_open AS open, version, roles, reason
FROM policy_decisions;

DROP VIEW IF EXISTS v_switch_phases;
CREATE VIEW v_switch_phases AS  -- switch times by direction: the figures the paper reports (8.52 s / 3.46 s)
SELECT from_role || ' -> ' || to_role AS direction, count(*) AS switches, round(avg(duration_s), 3) AS mean_s,
       round(min(duration_s), 3) AS min_s, round(max(duration_s), 3) AS max_s,
       round(avg(ended_at - started_at), 3) AS mean_node_s
FROM role_switches WHERE status = 'DONE' GROUP BY from_role, to_role;

DROP VIEW IF EXISTS v_shards;
CREATE VIEW v_shards AS  -- per step: its shards, which cell computed each, what was redone, time per shard
SELECT m.step, count(DISTINCT m.shard) AS shards, sum(m.status = 'DONE') AS done,
       sum(m.status IN ('QUEUED', 'TAKEN')) AS open, sum(m.status = 'FAILED') AS failed,
       (SELECT group_concat('cell ' || d.cell || ': ' || d.n, ', ')
        FROM (SELECT done_by AS cell, count(*) AS n FROM shards
              WHERE step = m.step AND status = 'DONE' GROUP BY done_by ORDER BY done_by) d) AS done_by_cell,
       count(DISTINCT CASE WHEN m.status = 'DONE' THEN m.done_by END) AS cells,
       sum(m.attempts > 1) AS redone, sum(CASE WHEN m.status = 'DONE' THEN m.tokens END) AS tokens,
       round(avg(CASE WHEN m.status = 'DONE' THEN m.done_at - m.taken_at END), 3) AS mean_shard_s
FROM shards m GROUP BY m.step;

DROP VIEW IF EXISTS v_step_overlap;
CREATE VIEW v_step_overlap AS  -- per step: training seconds, of them while runs still rolled out, and the share
SELECT step, policy, round(json_extract(metrics, '$.train_busy_s'), 3) AS train_busy_s,
       round(json_extract(metrics, '$.overlap_s'), 3) AS overlap_s,
       round(json_extract(metrics, '$.overlap_share'), 3) AS overlap_share,
       round(json_extract(metrics, '$.open_s'), 3) AS open_s, round(train_s, 3) AS step_train_s
FROM train_steps WHERE status = 'DONE' ORDER BY step;

DROP VIEW IF EXISTS v_harness_errors;
CREATE VIEW v_harness_errors AS  -- finished runs whose harness failed, never called the model or reported API errors
SELECT id AS rollout, kind, status, group_id, eval_id, cell_id AS cell, n_calls AS calls, reward,
       datetime(ended_at, 'unixepoch') AS ended, round(ended_at - started_at, 2) AS duration_s,
       substr(error, 1, instr(error || char(10), char(10)) - 1) AS first_line, error, workspace
FROM rollouts
WHERE status = 'INFRA_ERROR' OR (status IN ('COMPLETED', 'TIMEOUT_SCORED') AND error IS NOT NULL);

DROP VIEW IF EXISTS v_weight_transfers;
CREATE VIEW v_weight_transfers AS  -- per version and transport: how fast its receivers got it, and who failed
SELECT t.version, w.transport AS published_as, t.transport, count(DISTINCT t.receiver) AS receivers, sum(t.ok) AS ok,
       sum(NOT t.ok) AS failed, sum(CASE WHEN t.ok THEN t.bytes END) AS bytes,
       round(avg(CASE WHEN t.ok THEN t.seconds END), 3) AS mean_s,
       round(min(CASE WHEN t.ok THEN t.gib_s END), 3) AS min_gib_s,
       round(avg(CASE WHEN t.ok THEN t.gib_s END), 3) AS mean_gib_s,
       group_concat(CASE WHEN NOT t.ok THEN t.receiver || ': ' || t.error END, '; ') AS errors
FROM weight_transfers t LEFT JOIN weight_versions w ON w.version = t.version
GROUP BY t.version, t.transport;

DROP VIEW IF EXISTS v_eval;
CREATE VIEW v_eval AS  -- per evaluation: the version, pass@1, pass@k, mean score on the held-out tasks
SELECT e.id AS eval, e.version, e.step, e.reason, e.status, e.n_tasks AS tasks, e.samples, e.n_runs AS runs,
       e.n_excluded AS excluded, round(e.pass_at_1, 4) AS pass_at_1, e.k, round(e.pass_at_k, 4) AS pass_at_k,
       round(e.score_mean, 4) AS score_mean, round(e.timeout_share, 4) AS timeout_share, e.mixed_versions,
       e.temperature, datetime(e.created_at, 'unixepoch') AS started, round(e.ended_at - e.created_at, 1) AS eval_s
FROM evals e ORDER BY e.id;

DROP VIEW IF EXISTS v_eval_tasks;
CREATE VIEW v_eval_tasks AS  -- per evaluation and task: how many of its runs passed, and their mean score
SELECT r.eval_id AS eval, e.version, t.key AS task, count(*) AS runs,
       sum(r.status IN ('COMPLETED', 'TIMEOUT_SCORED', 'TRUNCATED_CONTEXT')) AS scored,
       sum(r.status IN ('COMPLETED', 'TIMEOUT_SCORED', 'TRUNCATED_CONTEXT') AND r.reward >= e.pass_score) AS passed,
       round(avg(CASE WHEN r.status IN ('COMPLETED', 'TIMEOUT_SCORED', 'TRUNCATED_CONTEXT') THEN r.reward END), 4)
           AS score_mean
FROM rollouts r JOIN evals e ON e.id = r.eval_id JOIN tasks t ON t.id = r.task_id
WHERE r.kind = 'eval' GROUP BY r.eval_id, r.task_id ORDER BY r.eval_id, t.key;
