"""The last steps of a prepare (``experiments.training.preparing._Prepare``), as mixins: keeping both
sides of the split non-empty (the one document that may cross, ``SplitBalance``), and the checks and
the manifest written last (``ManifestWriter``). Moved out of ``preparing``; they use its state.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from experiments.training.corpus import VALID_SOURCES, _skipped_text
from experiments.training.shards import FORMAT, KIND, SPLITS, NoSpaceError, ShardWriter, shard_names


class SplitBalance:
    """``_Prepare``'s split balancing (its ``records``, ``_tokenize``, ``_write_record``, ``_no_space``)."""

    def _wanted_move(self, records: dict) -> tuple[int, str, int] | None:
        if self.val_fraction == 0:
            return None
        n = {s: sum(r["base"][s] for r in records.values()) for s in SPLITS}
        if n["train"] + n["val"] < 2:
            return None
        if n["val"] == 0:  # the train document nearest the threshold crosses over
            u, i, k = min(
                (r["base"]["train_min"][0], i, r["base"]["train_min"][1])
                for i, r in records.items()
                if r["base"]["train_min"]
            )
            return i, "train", k
        if n["train"] == 0:
            u, i, k = max(
                (r["base"]["val_max"][0], -i, r["base"]["val_max"][1])
                for i, r in records.items()
                if r["base"]["val_max"]
            )
            return -i, "val", k
        return None

    def _balance_split(self, records: dict) -> dict:
        """Apply the one move that keeps both sides non-empty, decided from every shard's own
        documents, undoing a move a resumed run's kept shard holds that these inputs do not want."""
        move = self._wanted_move(records)
        for i, r in sorted(records.items()):
            want = [move[1], move[2]] if move and move[0] == i else None
            if r["moved"] != want:
                if r["moved"] is not None:
                    records.update(self._tokenize([i], records))
                if want is not None:
                    records[i] = self._move(records[i], *want, records)
        return records

    def _move(self, r: dict, src: str, k: int, records: dict) -> dict:
        i = r["index"]
        dst = "val" if src == "train" else "train"
        names = shard_names(i)
        idx = np.fromfile(self.out / names[src][1], dtype=np.int64)
        tokens = np.fromfile(self.out / names[src][0], dtype=self.dtype)
        lengths = np.diff(idx)
        a, b = int(idx[k]), int(idx[k + 1])
        writer = ShardWriter(self.out, i, self.dtype)
        try:
            writer.add(src, np.concatenate([tokens[:a], tokens[b:]]), np.delete(lengths, k))
            writer.add(dst, tokens[a:b], np.array([b - a], dtype=np.int64))  # dst is empty in every shard
            files = writer.commit()
        except NoSpaceError as e:
            raise self._no_space(e, i, records) from None
        except BaseException:
            writer.abort()
            raise
        r = dict(r, files=files, moved=[src, k])
        moved_bytes = r["base"]["train_min" if src == "train" else "val_max"][2]
        text = {src: r[src]["text_bytes"] - moved_bytes, dst: r[dst]["text_bytes"] + moved_bytes}
        for s in SPLITS:
            r[s] = {"docs": writer.docs[s], "tokens": writer.tokens[s], "text_bytes": text[s]}
        self._write_record(i, r, records)
        return r


class ManifestWriter:
    """``_Prepare``'s per-source counts, document checks and manifest."""

    def _source_counts(self, records: dict) -> list[dict]:
        out = []
        for j, src in enumerate(self.sources):
            docs, skipped = 0, Counter(src.skipped)
            for r in records.values():
                s = r["sources"].get(str(j))
                if s:
                    docs += s["docs"]
                    skipped.update(s["skipped"])
            out.append({**src.describe(), "docs": docs, "skipped": dict(sorted(skipped.items()))})
        return out

    def _check_documents(self, records: dict) -> None:
        counts = self._source_counts(records)
        for src, c in zip(self.sources, counts):
            if c["docs"] == 0:
                raise ValueError(
                    f"source {src.given!r} holds no documents ({_skipped_text(Counter(c['skipped']))}); "
                    f"expected {VALID_SOURCES}"
                )
        total = sum(c["docs"] for c in counts)
        if self.val_fraction > 0 and total < 2:
            raise ValueError(
                f"the sources hold {total} document: a train/validation split needs 2 or more; give more documents "
                "(a .jsonl with one per line) or --val-fraction 0"
            )

    def _manifest(self, records: dict) -> dict:
        shards = [records[i] for i in range(len(self.shards))]
        files = {name: d for r in shards for name, d in r["files"].items()}
        counts = {s: {k: sum(r[s][k] for r in shards) for k in ("docs", "tokens", "text_bytes")} for s in SPLITS}
        return {
            "kind": KIND,
            "format": FORMAT,
            "tokenizer": self.tok.describe(),
            "separator": self.tok.separator.as_dict(),
            "vocab_size": self.vocab_size,
            "dtype": self.dtype.name,
            "params": self.params,
            "split": {
                "by": "content",
                "hash": "xxh3_64 of the document's UTF-8, seeded by split_seed",
                "val_if": "hash < val_fraction * 2**64",
                "moved": next(([r["index"], *r["moved"]] for r in shards if r["moved"]), None),
            },
            "sources": self._source_counts(records),
            "sources_hash": self.sources_hash,
            "counts": {
                "docs": counts["train"]["docs"] + counts["val"]["docs"],
                "text_bytes": sum(r["text_bytes"] for r in shards),
                **counts,
            },
            "shards": [
                {
                    "index": r["index"],
                    "train": r["train"],
                    "val": r["val"],
                    "text_bytes": r["text_bytes"],
                    "moved": r["moved"],
                }
                for r in shards
            ],
            "files": files,
        }
