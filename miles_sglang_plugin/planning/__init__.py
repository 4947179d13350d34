"""Stage 2, planning: a pure resolution (:mod:`.resolution`, Miles' rules) from the deployment as written and the
trainer's inputs to a frozen plan (:mod:`.plan`: models, groups, engines, GPU slots, offload), and its views
(:mod:`.views`)."""
