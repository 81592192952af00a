"""One module per model family: its tensor-parallel table(s) and, where its config.json is
unusual, its config readers (exo_tp.arch.family.Family). exo_tp.arch.registry lists them;
docs/planner.md ("Adding a family") walks through adding one."""
