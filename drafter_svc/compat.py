"""Does a DFlash drafter fit a target? Decided from the two config.json files alone (no torch, no weights).

`pdflash up` / `pdflash demo` and `pdflash serve-drafter` ask before anything starts, so a drafter made for
another target is refused with one line instead of failing inside a service that is already loading;
`DFlashFactory` asks the same question again of the loaded tensors (`check_compatible`).
"""

from __future__ import annotations

import json
import pathlib


def read_config(directory: str | pathlib.Path, what: str = "") -> dict:
    """config.json of a checkpoint, with a multimodal `text_config` merged over the top level. `what` names the
    checkpoint in the error ("target checkpoint ")."""
    path = pathlib.Path(directory) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{what}{directory} has no config.json")
    cfg = json.loads(path.read_text())
    text = cfg.get("text_config")
    return {**cfg, **text} if isinstance(text, dict) else cfg


def target_layers(drafter_dir: str | pathlib.Path) -> tuple[int, ...]:
    """The target layers whose outputs a DFlash drafter reads (its Prefill's feature_layer_ids, in that order), from
    its config.json; () when the directory holds no readable DFlash drafter."""
    try:
        dflash = read_config(drafter_dir).get("dflash_config") or {}
        return tuple(int(i) for i in dflash.get("target_layer_ids", ()))
    except (OSError, ValueError, TypeError, AttributeError):
        return ()


def mismatch(drafter_dir, target_dir, *, drafter_hidden: int, target_layer_ids: list[int], mask_token_id: int,
             block_size: int, target_hidden: int, target_layers: int, target_vocab: int) -> str | None:
    """Why the drafter cannot condition on / decode through the target (None: it fits)."""
    if drafter_hidden != target_hidden:
        return (f"drafter {drafter_dir} has hidden_size {drafter_hidden} but target {target_dir} has "
                f"{target_hidden}: the drafter was made for another target")
    bad = [i for i in target_layer_ids if not 0 <= i < target_layers]
    if bad or not target_layer_ids:
        return (f"drafter {drafter_dir} conditions on target layers {list(target_layer_ids)}, but target "
                f"{target_dir} has layers 0..{target_layers - 1}: the drafter was made for another target")
    if not 0 <= mask_token_id < target_vocab:
        return (f"drafter {drafter_dir} mask_token_id {mask_token_id} is outside the vocabulary of target "
                f"{target_dir} ({target_vocab} tokens): the drafter was made for another target")
    if block_size < 2:
        return f"drafter {drafter_dir} block_size {block_size} must be >= 2"
    return None


def drafter_mismatch(drafter_dir: str | pathlib.Path, target_dir: str | pathlib.Path) -> str | None:
    """Why the DFlash drafter in drafter_dir does not fit the target in target_dir, from their config.json (None: fits)."""
    try:
        d = read_config(drafter_dir)
        t = read_config(target_dir)
    except (OSError, ValueError) as e:  # missing or unreadable config.json
        return str(e)
    dflash = d.get("dflash_config")
    if not isinstance(dflash, dict) or "mask_token_id" not in dflash or "target_layer_ids" not in dflash:
        return f"{drafter_dir} is not a DFlash drafter (its config.json has no dflash_config with mask_token_id and target_layer_ids)"
    try:
        return mismatch(
            drafter_dir, target_dir,
            drafter_hidden=int(d["hidden_size"]), target_layer_ids=[int(i) for i in dflash["target_layer_ids"]],
            mask_token_id=int(dflash["mask_token_id"]), block_size=int(d.get("block_size", 16)),
            target_hidden=int(t["hidden_size"]), target_layers=int(t["num_hidden_layers"]), target_vocab=int(t["vocab_size"]),
        )
    except (KeyError, TypeError, ValueError) as e:
        return f"cannot read the sizes of drafter {drafter_dir} / target {target_dir} from their config.json: {e!r}"
