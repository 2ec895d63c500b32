"""``python -m envd`` (and the PyInstaller entry script)."""

from envd.server import main

if __name__ == "__main__":
    main()
