"""Stage 2, planning: a pure resolution (:mod:`.resolution`) from the deployment as written and the trainer's
inputs, after Miles' own rules for those inputs (:mod:`.miles_rules`), to a frozen plan (:mod:`.plan`: models,
groups, engines, GPU slots, offload), and its views (:mod:`.views`)."""
