# test_my_client.py: your client against the stub, and the same test against the real stack
import grpc
import pytest

from pdflash.v1 import drafter_pb2, drafter_pb2_grpc


def complete(address: str, prompt: str):  # the client under test: yours
    with grpc.insecure_channel(address) as channel:
        request = drafter_pb2.GenerateRequest(prompt=prompt, max_tokens=8, ignore_eos=True)
        *chunks, last = drafter_pb2_grpc.DrafterStub(channel).Generate(request, timeout=30)
    return [t for m in chunks for t in m.chunk.token_ids], last.final


@pytest.mark.parametrize("server", ["pdflash_stub", "pdflash_stack"])
def test_complete(server, request):
    tokens, final = complete(request.getfixturevalue(server).address, "def fib(n):")
    assert len(tokens) == final.usage.completion_tokens == 8
