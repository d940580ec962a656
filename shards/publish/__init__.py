"""Publishing finished outputs: uploads to object storage (manifest last) under a writer's lease."""
