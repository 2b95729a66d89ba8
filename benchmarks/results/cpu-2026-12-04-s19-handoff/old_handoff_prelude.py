import asyncio
import boundgen.server.infer as infer_mod

class _Wrap:
    watch = staticmethod(asyncio.wrap_future)

infer_mod.Infer._loop_handoff = lambda self: _Wrap
print("old hand-off (asyncio.wrap_future per request)", flush=True)
