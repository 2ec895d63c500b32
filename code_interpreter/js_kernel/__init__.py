"""aenv's JavaScript kernel: Node.js behind ipykernel's wrapper-kernel base (see ``kernel``)."""
