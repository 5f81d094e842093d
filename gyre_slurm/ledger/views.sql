-- Views over the run ledger: the questions users ask, answered in SQL. Documented in the README.
-- now() in epoch seconds, portable to older SQLite: (julianday('now') - 2440587.5) * 86400.0

DROP VIEW IF EXISTS v_cells;
CREATE VIEW v_cells AS
SELECT c.id AS cell, CASE WHEN c.is_core THEN 'core' ELSE 'satellite' END AS kind, c.role, c.target_role,
       (SELECT count(*) FROM agents a WHERE a.cell_id = c.id AND a.status = 'UP') AS agents_up, c.n_nodes,
       round((julianday('now') - 2440587.5) * 86400.0 - c.last_heartbeat, 1) AS heartbeat_age_s,
       round((julianday('now') - 2440587.5) * 86400.0 - s.started_at, 1) AS in_role_s
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
CREATE VIEW v_rollouts_by_status AS
SELECT status, count(*) AS rollouts, round(avg(reward), 4) AS mean_reward,
       round(avg(ended_at - started_at), 2) AS mean_duration_s,
       sum(prompt_tokens) AS prompt_tokens, sum(completion_tokens) AS completion_tokens
FROM rollouts GROUP BY status;

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
