"""The teacher's routes: the class's usage as CSV, and reloading the keys (SPEC H7).

    GET  /scheduler/usage.csv    one row per tenant (usage.py): every tenant for a key
                                 granted may_read_all_stats, else the caller's own row
    POST /admin/reload-keys      read --api-keys-file again (keys.py), as SIGHUP does;
                                 for a key granted may_reload_keys

    curl -H "Authorization: Bearer $TEACHER_KEY" localhost:8000/scheduler/usage.csv > lab3.csv

A reload that is refused (a bad file) answers 400 with the line to change, and the
old keys stay; one that takes answers the counts and the tenants added and removed.
Neither answer, nor the log line written for each, holds a character of any key.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from .errors import OpenAIError
from .keys import reload_message

LOG = logging.getLogger("minserve")


def reload_keys(state, trigger: str) -> dict[str, Any]:
    """Reload the keys file of the app with this `state`, logging either way; ValueError
    (the message, the old keys kept) if the file is refused."""
    ring = state.keyring
    if ring is None or ring.path is None:
        LOG.warning("%s: this server was started without --api-keys-file; there is no keys "
                    "file to reload (it goes on serving)", trigger)
        raise ValueError(f"{trigger}: this server was started without --api-keys-file; "
                         "there is no keys file to reload")
    try:
        summary = ring.reload()
    except ValueError as e:
        LOG.error("%s: the keys file was NOT reloaded, the %d keys in use stay: %s", trigger,
                  len(ring.keys), e)
        raise
    LOG.info("%s: %s", trigger, reload_message(summary, ring.path))
    return summary


def usage_view(app, who) -> dict[str, Any]:
    """The usage ledger as `who` may read it: every tenant (and the refusals of clients
    without a key) for a key granted `may_read_all_stats`, else its own row."""
    if who.may_read_all_stats:
        ring = app.state.keyring
        names = {t.name for t in ring.keys.values()} if ring is not None else {who.name}
        return app.state.ledger.view(sorted(names | app.state.ledger.known_tenants()),
                                     anonymous=True)
    return app.state.ledger.view([who.name], anonymous=False)


def install_teacher_routes(app: FastAPI, caller) -> None:
    @app.get("/scheduler/usage.csv")
    def usage_csv(request: Request) -> Response:
        rows = usage_view(app, caller(request))["tenants"]
        return Response(app.state.ledger.csv(sorted(rows)), media_type="text/csv",
                        headers={"content-disposition": 'attachment; filename="usage.csv"'})

    @app.post("/admin/reload-keys")
    async def admin_reload_keys(request: Request) -> dict[str, Any]:
        if not caller(request).may_reload_keys:
            raise OpenAIError(403, 'reloading the keys needs a key granted "may_reload_keys": '
                                   "true in --api-keys-file (or send SIGHUP to the server)",
                              "permission_error", code="reload_not_granted")
        try:
            return {"reloaded": True, **reload_keys(app.state, "POST /admin/reload-keys")}
        except ValueError as e:
            raise OpenAIError(400, str(e), code="keys_file_refused") from None
