"""Training MTP heads (`train.mtp`, torch); this package's root stays light for the CLI."""

# what a written head's matrices can be stored as (`mtpllm train-mtp --head-type`). A draft step
# reads every byte of them once per drafted token, so a smaller type drafts faster; on the 1.5B's
# head (10 held-out prompts, k=3): Q8_0 2.176, Q5_0 2.168, Q4_0 2.154 mean acceptance length
HEAD_TYPES = ("q8_0", "q5_0", "q4_0", "f16", "f32")
