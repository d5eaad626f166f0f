"""``/docs``: Swagger UI over ``/openapi.json``, its scripts and styles served from the ``swagger-ui-bundle-v2``
package (``/docs/assets/...``), so the page works with no network: nothing is fetched from a CDN."""

from __future__ import annotations

from fastapi import APIRouter, FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from starlette.responses import HTMLResponse
from starlette.staticfiles import StaticFiles

ASSETS = "/docs/assets"

router = APIRouter()


@router.get("/docs", include_in_schema=False)
async def swagger_ui() -> HTMLResponse:
    return get_swagger_ui_html(
        openapi_url="/openapi.json",
        title="memfit serve",
        swagger_js_url=f"{ASSETS}/swagger-ui-bundle.js",
        swagger_css_url=f"{ASSETS}/swagger-ui.css",
        swagger_favicon_url=f"{ASSETS}/favicon-32x32.png",
    )


def mount_assets(app: FastAPI) -> None:
    """Serve Swagger UI's files under :data:`ASSETS` (a mount, which a router cannot carry)."""
    from swagger_ui_bundle import swagger_ui_path

    app.mount(ASSETS, StaticFiles(directory=str(swagger_ui_path)), name="swagger-ui")
