"""The example's agent and its tools: a weather lookup, a clock and an umbrella
order that waits for a person's approval, all in-process; and where the agent's
model comes from (a provider from DEMO_LLM_*, else the built-in offline model)."""

from __future__ import annotations

import os
import threading
from datetime import UTC, datetime

from flask_solidloop import Agent, CallContext, SolidLoop, Toolset

solidloop = SolidLoop()
weather = Toolset("weather")

#: Where ``flask solidloop demo`` puts the URL of the offline model it serves.
OFFLINE_URL_ENV = "SOLIDLOOP_OFFLINE_LLM_URL"

_FORECASTS = {
    "paris": "Sunny, 21°C, light wind from the west",
    "london": "Overcast, 15°C, drizzle in the afternoon",
    "tokyo": "Humid, 27°C, clear skies",
}


@weather.tool
def get_weather(city: str, ctx: CallContext) -> str:
    """Current weather for a city.

    Args:
        city: City name, e.g. Paris.
    """
    forecast = _FORECASTS.get(city.strip().lower())
    if forecast is None:
        raise ValueError(f"no weather data for {city!r}; try one of: Paris, London, Tokyo")
    return f"{forecast} in {city}."


@weather.tool
def current_time(timezone: str = "UTC") -> dict:
    """The current date and time (UTC only in this demo).

    Args:
        timezone: IANA timezone name; only UTC is supported here.
    """
    return {"timezone": "UTC", "iso": datetime.now(UTC).isoformat(timespec="seconds")}


# Each call waits for a person (the chat page shows Approve / Deny) before it runs.
# Its words share none with the demo's question, so the offline model still
# answers that one with get_weather.
@weather.tool(requires_approval=True)
def order_umbrella(city: str, ctx: CallContext) -> str:
    """Order an umbrella, delivered to an address in a city; someone approves each order.

    Args:
        city: City to deliver to.
    """
    return f"Umbrella ordered for delivery in {city} (order {ctx.idempotency_key})."


_offline_lock = threading.Lock()


def offline_model_url() -> str:
    """The URL of the built-in offline model: the one ``flask solidloop demo``
    serves (it exports SOLIDLOOP_OFFLINE_LLM_URL to its workers), else one
    served by this process, started the first time it is needed. So
    ``flask run`` and ``flask solidloop worker`` need no API key either: each
    worker process answers its turns from its own copy (it is deterministic,
    so which copy answers does not matter)."""
    url = os.environ.get(OFFLINE_URL_ENV)
    if url:
        return url
    with _offline_lock:
        url = os.environ.get(OFFLINE_URL_ENV)
        if not url:
            from flask_solidloop.testing import LLMEmulator

            url = LLMEmulator(offline_model=True).start().base_url
            os.environ[OFFLINE_URL_ENV] = url
        return url


def provider_from_env() -> dict:
    """An OpenAI-compatible provider from DEMO_LLM_*, else the built-in offline model."""
    base_url = os.environ.get("DEMO_LLM_BASE_URL")
    if base_url:
        settings = {"base_url": base_url, "model": os.environ.get("DEMO_LLM_MODEL", "gpt-4o-mini"),
                    "read_timeout": 120}
        if os.environ.get("DEMO_LLM_API_KEY"):
            settings["api_key_env"] = "DEMO_LLM_API_KEY"
        return settings
    return {"base_url": offline_model_url(), "model": "solidloop-offline", "read_timeout": 30}


@solidloop.agent("weather")
class WeatherAgent(Agent):
    system_prompt = (
        "You answer questions about the weather. Use the get_weather tool; never guess."
    )
    mcps = [{"name": "weather", "toolset": weather}]
    max_steps = 10
    streaming = True  # the chat page shows the answer as it is written

    def llm(self) -> dict:
        return provider_from_env()
