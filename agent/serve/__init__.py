"""vLLM serving: GPU description, model shape, KV planning, flag selection, launch and endpoints."""
