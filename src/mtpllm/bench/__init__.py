"""`mtpllm bench`: workloads, runner, reports."""
