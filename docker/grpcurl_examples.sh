#!/bin/sh
# grpcurl against a running pdflash stack (compose, or `pdflash up` on this host). Reflection is on,
# so no .proto files are needed. The README shows these lines verbatim and tests/test_grpcurl.py
# runs every line that starts with `grpcurl` (with the stack's addresses in place of localhost:PORT).
# Run them all: sh docker/grpcurl_examples.sh
set -eux

# The public API (the drafter).
grpcurl -plaintext localhost:50051 list
grpcurl -plaintext localhost:50051 describe pdflash.v1.Drafter
grpcurl -plaintext localhost:50051 describe pdflash.v1.GenerateRequest
grpcurl -plaintext -d '{"prompt": "def fib(n):", "max_tokens": 16}' localhost:50051 pdflash.v1.Drafter/Generate
grpcurl -plaintext -d '{"prompt": "def fib(n):"}' localhost:50051 pdflash.v1.Drafter/Tokenize
grpcurl -plaintext -d '{"service": "pdflash.v1.Drafter"}' localhost:50051 grpc.health.v1.Health/Check

# The internal services (published only by `pdflash up`, not by compose).
grpcurl -plaintext localhost:50052 list
grpcurl -plaintext -d '{"service": "pdflash.v1.Scheduler"}' localhost:50052 grpc.health.v1.Health/Check
grpcurl -plaintext localhost:50053 list
grpcurl -plaintext -d '{"service": "pdflash.v1.Verifier"}' localhost:50053 grpc.health.v1.Health/Check
