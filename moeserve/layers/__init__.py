"""Model building blocks: MLA attention, MoE, dense MLP, norms, rotary embedding, sampler."""
