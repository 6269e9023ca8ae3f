"""Speculative decoding: proposers (n-gram prompt lookup, a draft model) and the policy that says how many
tokens each request may draft. Verification is the sampler's side (model_executor/rejection_sampler.py); the
scheduler and KV manager only see drafts as extra tokens of a step (core/)."""
