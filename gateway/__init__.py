"""The OpenAI-compatible gateway: turns requests into Route Sessions and relays their token streams (SSE)."""
