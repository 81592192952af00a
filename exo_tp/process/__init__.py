"""Processes exo-tp starts: their lifetime and their supervision.

- `supervisor`: the one `Supervisor`: takes a typed `Job`, reports `events.ProcessEvent`s
  (connected, phase, ready, heartbeat, result, failed with its reason, exited); watches
  heartbeats for stalls. Serving ranks (`exo_tp.runtime.rank_process`), fine-tuning ranks,
  link probes and local nodes (`exo_tp.node.local_cluster.LocalCluster`) all run under it.
- `messages`: what a child says (base classes a child's own link subclasses, and the plain
  union); `child`: the child's end (find the supervisor, report, fail in one line).
- `lifecycle`: children die with their parent; SIGTERM runs `finally` blocks.
"""
