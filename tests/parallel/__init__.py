"""The plan stages against one rank: TP, EP, CP, FSDP, kernel swaps, MX (fsdp2_backend/parallel/)."""
