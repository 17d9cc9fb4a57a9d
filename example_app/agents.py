"""The demo agent and its tools: a weather lookup and a clock, both in-process."""

from __future__ import annotations

import os
from datetime import UTC, datetime

from flask_solidloop import Agent, CallContext, SolidLoop, Toolset

solidloop = SolidLoop()
weather = Toolset("weather")

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


def provider_from_env() -> dict:
    """An OpenAI-compatible provider from DEMO_LLM_*, else the built-in offline model."""
    base_url = os.environ.get("DEMO_LLM_BASE_URL")
    if base_url:
        settings = {"base_url": base_url, "model": os.environ.get("DEMO_LLM_MODEL", "gpt-4o-mini"),
                    "read_timeout": 120}
        if os.environ.get("DEMO_LLM_API_KEY"):
            settings["api_key_env"] = "DEMO_LLM_API_KEY"
        return settings
    offline = os.environ.get("SOLIDLOOP_OFFLINE_LLM_URL", "http://127.0.0.1:9")
    return {"base_url": offline, "model": "solidloop-offline", "read_timeout": 30}


@solidloop.agent("weather")
class WeatherAgent(Agent):
    system_prompt = (
        "You answer questions about the weather. Use the get_weather tool; never guess."
    )
    mcps = [{"name": "weather", "toolset": weather}]
    max_steps = 10

    def llm(self) -> dict:
        return provider_from_env()
