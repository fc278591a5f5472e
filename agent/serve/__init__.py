"""vLLM serving: GPU description, model shape, KV planning, flag selection and launch."""
