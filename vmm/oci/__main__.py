"""CLI: pull an image, build its guest disk, or make a bootable image of it (prints JSON).

    python -m vmm.oci pull  <ref> [--insecure] [--username U --password-stdin]
    python -m vmm.oci disk  <ref> [...]        # pull + disk
    python -m vmm.oci image <ref> [--name N] [...]   # pull + disk + GuestImage
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from vmm.images import DEFAULT_IMAGES_DIR, ImageNotFound, find_image
from vmm.oci import kmods
from vmm.oci.disks import ensure_disk
from vmm.oci.errors import ImagePullError, OciError
from vmm.oci.guest import guest_image
from vmm.oci.store import pull


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vmm.oci", description=__doc__.splitlines()[0])
    parser.add_argument("cmd", choices=["pull", "disk", "image"])
    parser.add_argument("ref")
    parser.add_argument("--images-dir", type=Path, default=Path(os.environ.get("AENV_IMAGES_DIR", DEFAULT_IMAGES_DIR)))
    parser.add_argument("--insecure", action="store_true", help="plain HTTP or an untrusted certificate")
    parser.add_argument("--username")
    parser.add_argument("--password-stdin", action="store_true", help="read the password from stdin")
    parser.add_argument("--name", help="image name (image only; default oci-<digest prefix>)")
    parser.add_argument("--base", default="base",
                        help="the image whose kernel (its NFS modules go on the disk), initrd and tools to use")
    args = parser.parse_args(argv)
    credentials = None
    if args.username:
        credentials = (args.username, sys.stdin.readline().rstrip("\n") if args.password_stdin else "")
    progress = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    try:
        pulled = pull(args.ref, args.images_dir, credentials=credentials, insecure=args.insecure, progress=progress)
        if args.cmd == "pull":
            print(json.dumps(pulled.to_json(), indent=2))
            return 0
        modules = kmods.for_image(args.images_dir, find_image(args.images_dir, args.base), progress=progress)
        disk = ensure_disk(args.images_dir, pulled, progress=progress, modules=modules)
        if args.cmd == "disk":
            print(json.dumps({"dir": str(disk.dir), "reused": disk.reused, **disk.meta}, indent=2))
            return 0
        image = guest_image(args.images_dir, disk, name=args.name, base=args.base)
        print(json.dumps(image.to_json(), indent=2))
        return 0
    except ImagePullError as e:
        print(f"error ({e.kind}): {e}", file=sys.stderr)
        return 2
    except (OciError, ImageNotFound) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
