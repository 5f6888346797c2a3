"""The model registry and this project's model implementations (fsdp2_backend/models/)."""
