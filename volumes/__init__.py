"""Team volumes: persistent storage that outlives sandboxes, mounted by several at once."""
