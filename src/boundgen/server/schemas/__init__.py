"""Request/response types of the HTTP API, one module per peer whose clients call boundgen:

- `sglang`: `/v1/score` (`ScoringRequest`/`ScoringResponse`) and SGLang's `/v1/rerank` reply;
- `vllm`: vLLM's `/score` shape, `/classify`, `/pooling`, `/tokenize`, `/detokenize`;
- `openai`: `/v1/embeddings` (with vLLM's extras);
- `cohere`: `/v1|v2/rerank` (Cohere's and vLLM's fields) and `/v1|v2/embed`;
- `tei`: text-embeddings-inference's `/embed`, `/embed_all`, `/rerank`, `/predict`, `/similarity`,
  `/tokenize`, `/decode`;
- `boundgen`: `/v1/beam`;
- `common`: what they share (the request base, usage, input types).

KServe v2 is parsed in `server/kserve.py`. Requests ignore fields outside the peer's type (clients
send extras such as `user`), except a near miss of a known one, a typo refused by name
(`server/fields.py`), and any unknown field on `/v1/beam`; known fields are strictly typed (no
silent coercion of `"1"` to `1`), and a peer field boundgen does not implement is refused by name
(`_Request.UNSUPPORTED`).
"""
