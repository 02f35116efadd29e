"""Paged MLA latent KV storage, page accounting and the radix (prefix) cache."""
