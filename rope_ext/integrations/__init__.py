"""Integrations that route other frameworks' models through rope_ext's ops:
rope_ext.integrations.transformers.patch(model) / unpatch(model)."""
