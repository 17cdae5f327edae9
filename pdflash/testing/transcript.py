"""Transcripts: Generate calls recorded from a real stack, to be answered again by the stub.

A transcript is JSON lines: a header `{"pdflash_transcript": 1, "upstream": ..., "model_info": {...}}`, then
one line per call: the request (its request_id left out: ids differ between runs), the response messages
in order, and how the call ended (`code`, `message`, and the `google.rpc.Status` details as base64 when the
server sent some). Messages are protobuf JSON with the .proto field names, so a transcript reads like
grpcurl output and can be edited by hand.

Replay matches a request by its every field but request_id. Several recorded answers to one request are
given in turn (the last one repeats): a retry recorded as UNAVAILABLE then a stream replays as such.
"""

from __future__ import annotations

import base64
import dataclasses
import difflib
import json
import pathlib

from google.protobuf import json_format

from pdflash.errors import NotFound
from pdflash.v1 import drafter_pb2

FORMAT = 1


def to_json(msg) -> dict:
    return json_format.MessageToDict(msg, preserving_proto_field_name=True)


def request_key(request: drafter_pb2.GenerateRequest) -> bytes:
    """What identifies a request: every field but request_id."""
    r = drafter_pb2.GenerateRequest()
    r.CopyFrom(request)
    r.request_id = ""
    return r.SerializeToString(deterministic=True)


@dataclasses.dataclass
class Call:
    """One recorded Generate: the request, its responses, how it ended."""

    request: drafter_pb2.GenerateRequest  # request_id cleared
    responses: list[drafter_pb2.GenerateResponse]
    code: str = "OK"  # a grpc.StatusCode name
    message: str = ""
    details: bytes = b""  # the serialized google.rpc.Status the server attached (grpc-status-details-bin)

    def to_line(self) -> str:
        d = {"request": to_json(self.request), "responses": [to_json(r) for r in self.responses], "code": self.code}
        if self.message:
            d["message"] = self.message
        if self.details:
            d["details"] = base64.b64encode(self.details).decode()
        return json.dumps(d, sort_keys=True)

    @classmethod
    def from_json(cls, d: dict) -> "Call":
        req = json_format.ParseDict(d["request"], drafter_pb2.GenerateRequest())
        req.request_id = ""
        return cls(
            request=req,
            responses=[json_format.ParseDict(r, drafter_pb2.GenerateResponse()) for r in d.get("responses", [])],
            code=d.get("code", "OK"),
            message=d.get("message", ""),
            details=base64.b64decode(d["details"]) if d.get("details") else b"",
        )


class Writer:
    """Appends calls to a transcript as they finish (each line flushed: a killed recorder loses no call)."""

    def __init__(self, path: str, upstream: str, model_info: drafter_pb2.ModelInfoResponse):
        self.path = path
        self._f = open(path, "w", encoding="utf-8")
        self._f.write(json.dumps({"pdflash_transcript": FORMAT, "upstream": upstream, "model_info": to_json(model_info)}) + "\n")
        self._f.flush()
        self.calls = 0

    def write(self, call: Call) -> None:
        self._f.write(call.to_line() + "\n")
        self._f.flush()
        self.calls += 1

    def close(self) -> None:
        self._f.close()


class Transcript:
    """A transcript read back: the recorded server's ModelInfo and the calls, looked up by request."""

    def __init__(self, path: str):
        self.path = path
        self.model_info: drafter_pb2.ModelInfoResponse | None = None
        self.calls: list[Call] = []
        for n, line in enumerate(pathlib.Path(path).read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                if "pdflash_transcript" in d:
                    if d["pdflash_transcript"] != FORMAT:
                        raise ValueError(f"format {d['pdflash_transcript']}, this pdflash reads {FORMAT}")
                    if d.get("model_info"):
                        self.model_info = json_format.ParseDict(d["model_info"], drafter_pb2.ModelInfoResponse())
                else:
                    self.calls.append(Call.from_json(d))
            except (ValueError, KeyError, json_format.ParseError) as e:
                raise ValueError(f"{path}:{n}: not a pdflash transcript line: {e}") from None
        self._by_key: dict[bytes, list[Call]] = {}
        for c in self.calls:
            self._by_key.setdefault(request_key(c.request), []).append(c)
        self._served: dict[bytes, int] = {}

    def answer(self, request: drafter_pb2.GenerateRequest) -> Call:
        """The recorded answer to this request (the next one, when several were recorded); NotFound naming
        the closest recorded request otherwise."""
        key = request_key(request)
        calls = self._by_key.get(key)
        if not calls:
            raise NotFound(self._not_found(request))
        i = self._served.get(key, 0)
        self._served[key] = i + 1
        return calls[min(i, len(calls) - 1)]

    def _not_found(self, request) -> str:
        head = f"no recorded answer to this Generate request in the transcript {self.path}"
        if not self.calls:
            return head + " (it records no call)"
        asked = to_json(_without_id(request))
        best = min(range(len(self.calls)), key=lambda i: _distance(asked, to_json(self.calls[i].request)))
        diffs = _differences(asked, to_json(self.calls[best].request))
        return f"{head} ({len(self.calls)} recorded); the closest is call #{best + 1}, which differs in " + "; ".join(diffs)


def _without_id(request):
    r = drafter_pb2.GenerateRequest()
    r.CopyFrom(request)
    r.request_id = ""
    return r


def _distance(a: dict, b: dict) -> tuple[int, float]:
    """Fields that differ, then how unlike the prompts are."""
    keys = set(a) | set(b)
    differing = sum(a.get(k) != b.get(k) for k in keys)
    pa, pb = json.dumps(a.get("prompt", a.get("prompt_tokens", ""))), json.dumps(b.get("prompt", b.get("prompt_tokens", "")))
    return differing, 1.0 - difflib.SequenceMatcher(None, pa, pb).ratio()


def _short(v) -> str:
    s = json.dumps(v) if v is not None else "(unset)"
    return s if len(s) <= 60 else s[:57] + "..."


def _differences(asked: dict, recorded: dict) -> list[str]:
    return [f"{k}: {_short(asked.get(k))} here, {_short(recorded.get(k))} recorded"
            for k in sorted(set(asked) | set(recorded)) if asked.get(k) != recorded.get(k)]
