"""The page served at `/` (issue 18): its routes and static files live on this router, which
serve/app.py mounts after the API's. The API key (--api-key) guards the API routes; a page route
that reads the model should depend on the same check (app.build_app's `check_key`)."""

from __future__ import annotations

from fastapi import APIRouter

router = APIRouter()
