"""What the user runs. Here, supervision: the topology (a config -> the processes and where they run), the supervisor
that starts, watches and stops them (only the launcher starts processes), readiness, joins and leftovers. The
`disagg` command is cli/, `disagg bench` is bench/."""
