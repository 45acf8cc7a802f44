"""Upload a local dataset directory to s3://bucket/prefix (any S3-compatible store), checking it
opens before and after. S3 settings come from the environment (AWS_ENDPOINT_URL,
AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION).

    python deploy/upload.py ./atlas s3://my-bucket/atlas [--overwrite]

config.json goes last, so an interrupted upload never looks like a dataset.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tqdm import tqdm  # noqa: E402

from coordination.errors import CellfeedError  # noqa: E402
from producers.dataset import open_dataset  # noqa: E402
from producers.storage import S3Location, location  # noqa: E402


def upload(source: str, target: str, overwrite: bool = False) -> None:
    local = open_dataset(source)  # refuse to upload something that is not a dataset
    dest = location(target)
    if not isinstance(dest, S3Location):
        raise CellfeedError(f"{target} is not an s3:// address")
    dest.check_reachable(for_write=True)
    if dest.exists():
        if not overwrite:
            raise CellfeedError(f"{target} already holds objects; pass --overwrite to replace them")
        dest.delete()
    root = Path(local.uri)
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.name != "config.json")
    total = sum(p.stat().st_size for p in files)
    with tqdm(total=total, unit="B", unit_scale=True, desc="upload") as bar:
        for path in files + [root / "config.json"]:
            key = dest.key_of(str(path.relative_to(root)))
            dest.client.upload_file(str(path), dest.bucket, key, Callback=bar.update)
    remote = open_dataset(target)
    if remote.shape != local.shape or remote.n_rows != local.n_rows:
        raise CellfeedError(
            f"uploaded dataset does not match: {remote.shape}/{remote.n_rows} vs {local.shape}/{local.n_rows}"
        )
    print(f"uploaded {local.n_cells:,} cells x {local.n_genes:,} genes ({total / 1e9:.2f} GB) to {target}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source")
    parser.add_argument("target")
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args()
    try:
        upload(args.source, args.target, args.overwrite)
    except CellfeedError as exc:
        print(f"upload: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
