import asyncio, collections, threading
import boundgen.server.infer as infer_mod

class _Inbox:
    def __init__(self, loop):
        self.loop = loop
        self.items = collections.deque()
        self.lock = threading.Lock()
        self.scheduled = False
    def post(self, work, fut):
        with self.lock:
            self.items.append((work, fut))
            if self.scheduled:
                return
            self.scheduled = True
        self.loop.call_soon_threadsafe(self.drain)
    def drain(self):
        with self.lock:
            items, self.items = self.items, collections.deque()
            self.scheduled = False
        for work, fut in items:
            if fut.cancelled():
                continue
            if work.cancelled():
                fut.cancel()
                continue
            exc = work.exception()
            if exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(work.result())

_inboxes = {}
def wrap_future(work):
    loop = asyncio.get_running_loop()
    box = _inboxes.get(loop)
    if box is None:
        box = _inboxes[loop] = _Inbox(loop)
    fut = loop.create_future()
    work.add_done_callback(lambda w: box.post(w, fut))
    return fut

class _NS: pass
ns = _NS(); ns.wrap_future = wrap_future
for name in dir(asyncio):
    if not hasattr(ns, name): setattr(ns, name, getattr(asyncio, name))
infer_mod.asyncio = ns
print("inbox prelude installed", flush=True)
