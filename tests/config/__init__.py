"""The native config: schema, loading and validation (fsdp2_backend/config/)."""
