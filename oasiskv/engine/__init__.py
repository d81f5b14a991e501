"""The dense engine core: sequences, KV blocks, scheduling, the model runner and the step loop."""
