"""The built-in models: created, warmed up (on demonstrations recorded with the harnesses' real CLIs against the
scripted proxy, for the long model) and found again under state/models/. Above harness/, proxy/, train/ and model/,
which it puts together; only the launchers (cli, launch/) and a cell's reference weights (agent/) come here."""
