"""Layer 6: writing one checkpoint: the save calls (entry), a file (save), in the background (async_save, its staging),
a sharded folder from FSDP2 (sharded), one file gathered from FSDP2 shards (full_state)."""
