"""Team volumes: their records (create, list, get, delete) and the mounts of sandboxes."""
