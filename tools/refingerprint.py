"""Re-record the target's tokenizer fingerprint in drafter checkpoints and draft-vocab counts made
before the fingerprint covered how text tokenizes (session 53: vocabulary + special tokens +
probe texts, shared/models.py `tokenizer_fingerprint`), after checking that they hold the old one.

    python tools/refingerprint.py TARGET FOLDER OLD_FINGERPRINT

FOLDER holds checkpoint folders (*/drafter.json) and/or token_counts.safetensors, e.g.
client/checkpoints/smollm2-135m (old eef6760a4c23680090c0f888059aed12) or a training run's folder.
Only the fingerprint changes; a file that records another fingerprint is refused, none is written.
"""
import argparse
import json
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file

from splitspec.shared.models import load_tokenizer, tokenizer_fingerprint


def main(target: str, folder: Path, old: str) -> None:
    new = tokenizer_fingerprint(load_tokenizer(target))
    cards = sorted(folder.glob("*/drafter.json")) + sorted(folder.glob("drafter.json"))
    for card in cards:
        recorded = json.loads(card.read_text())["target"]["tokenizer_fingerprint"]
        if recorded not in (old, new):
            raise SystemExit(f"{card} records {recorded}, not {old}: nothing written")
    counts = folder / "token_counts.safetensors"
    for card in cards:
        card.write_text(card.read_text().replace(old, new))
        print(f"{card}: {new}")
    if counts.exists():
        with safe_open(str(counts), framework="pt") as f:
            metadata, tensors = dict(f.metadata()), {k: f.get_tensor(k) for k in f.keys()}
        if metadata.get("tokenizer_fingerprint") not in (old, new):
            raise SystemExit(f"{counts} records {metadata.get('tokenizer_fingerprint')}, not {old}")
        save_file(tensors, str(counts), metadata={**metadata, "tokenizer_fingerprint": new})
        print(f"{counts}: {new}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("target", help="the target model (alias, path or Hugging Face id)")
    parser.add_argument("folder", type=Path)
    parser.add_argument("old_fingerprint")
    args = parser.parse_args()
    main(args.target, args.folder, args.old_fingerprint)
