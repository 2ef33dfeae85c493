"""The workers of ``Run``: started, watched, their results and failures collected. A part of
:class:`simpledbi.runtime.Runtime` (its state), in a module of its own; what runs in a worker is worker.py."""
from __future__ import annotations

from multiprocessing.connection import wait
from typing import Any, Callable, Dict, List

from .errors import ModelProcessDied, WorkerError
from .interrupts import children_deaf_to_ctrl_c
from .supervisor import exit_how
from .worker import worker_main


class Workers:
    def run_workers(self, target: Callable, worker_num: int, args=(), kwargs=None) -> List[Any]:
        kwargs = dict(kwargs or {})
        conns: Dict[Any, int] = {}   # a worker's pipe -> its rank
        for rank in range(worker_num):
            parent_end, child_end = self.ctx.Pipe(duplex=False)
            proc = self.ctx.Process(target=worker_main, name=f"simpledbi-worker-{rank}",
                                    args=(rank, target, tuple(args), kwargs, self.namespace, child_end))
            with children_deaf_to_ctrl_c():
                proc.start()
                child_end.close()
                self._tell_janitor("worker", proc.pid)
                self.worker_procs[rank] = proc
                conns[parent_end] = rank
        results: List[Any] = [None] * worker_num
        reported = set()
        sentinels = {p.sentinel: r for r, p in self.worker_procs.items()}   # until each exits

        def take(conn, rank):
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                conns.pop(conn, None)
                conn.close()
                return
            reported.add(rank)
            if msg[0] == "ok":
                results[rank] = msg[1]
            else:
                _, type_name, text, tb = msg
                raise WorkerError(f"worker {rank} raised {type_name}: {text}", rank, None, type_name, tb)

        while sentinels:
            if self.broken:
                name, why = next(iter(self.broken.items()))
                raise ModelProcessDied(why, self.ctls[name].hdr["broken_code"].item() or None)
            for obj in wait(list(conns) + list(sentinels), timeout=self.options.poll_interval):
                if obj in conns:
                    take(obj, conns[obj])
                elif obj in sentinels:
                    rank = sentinels.pop(obj)
                    proc = self.worker_procs[rank]
                    proc.join()
                    for conn, r in list(conns.items()):
                        if r == rank:
                            if conn.poll():
                                take(conn, rank)
                            conns.pop(conn, None)
                            conn.close()
                    if proc.exitcode != 0 and rank not in reported:
                        raise WorkerError(f"worker {rank} (pid {proc.pid}) died with "
                                          f"{exit_how(proc.exitcode)}", rank, proc.exitcode)
        for conn in conns:
            conn.close()
        return results
