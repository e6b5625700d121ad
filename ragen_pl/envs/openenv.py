"""OpenEnv both ways (``pip install 'ragen-pl[openenv]'``): any ragen-pl env served as an OpenEnv server, and any
OpenEnv server played as a ragen-pl env.

* Serving: ``ragen-pl serve --env sokoban`` (:func:`serve`) puts a ragen-pl env, built in or a plugin, behind
  OpenEnv's server (``openenv.core.env_server.create_app``: ``/ws`` sessions, ``/reset``, ``/step``, ``/health``,
  ``/schema``), so TRL, SkyRL, verifiers or any OpenEnv client trains on it. Each session plays its own copy of the
  env. Actions are ``{"action": "<text>"}``; observations carry the ``text``, the env's ``instructions`` and
  ``actions``, ``success``, ``action_is_valid``, ``action_is_effective`` and the ``state_id`` (GiGPO's anchor state),
  besides OpenEnv's ``reward`` and ``done``.
* Playing: ``--data.env=openenv --data.env.init_args.base_url=http://host:8000`` (:class:`OpenEnvClient`, entry point
  ``openenv``) plays each trajectory in its own WebSocket session on the server: a rollout of 128 trajectories holds
  128 sessions at once (start the server with ``--max-sessions`` at least that), stepped turn by turn.

Faults. Every message waits at most ``timeout_s``. Opening a session and the episode's reset are retried
``retries`` times (after 0.5 s, then 1 s, 2 s, ...): nothing is lost, the episode has not begun. A step is never
retried, because the episode's state lives in the server's session: a step that fails or times out fails its
trajectory (left out of the batch and counted, as any env failure; past ``--data.max_failed_share`` the run stops
with a checkpoint) with an error naming the URL and the episode's seed. An unreachable server at start is a one-line
error naming the URL.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import subprocess
import sys
import time
import uuid
from collections.abc import Hashable, Iterator, Sequence
from typing import Any

from ragen_pl.envs.base import Env, StepResult, anchor_state

__all__ = ["OpenEnvClient", "OpenEnvError", "build_app", "serve", "served"]

_NEEDS = "pip install 'ragen-pl[openenv]'"


class OpenEnvError(RuntimeError):
    """An OpenEnv server did not answer as it should (unreachable, timed out, closed, or an error reply)."""


# ---------------------------------------------------------------------------------------------- serving
@functools.cache
def _wire_models():
    """The action and observation models of ragen-pl's served envs (made once: openenv-core is an extra)."""
    try:
        from openenv.core.env_server.types import Action, Observation
    except ImportError as err:
        raise ImportError(f"OpenEnv needs openenv-core: {_NEEDS}") from err

    class TextAction(Action):
        """One action of a ragen-pl env, as the model wrote it (``Up``, ``Left || Down``'s parts, ``3 + 4``)."""

        action: str

    class TextObservation(Observation):
        """A ragen-pl env's observation and step info."""

        text: str = ""
        instructions: str = ""
        actions: list[str] | None = None
        success: bool = False
        action_is_valid: bool = True
        action_is_effective: bool = False
        state_id: int | None = None

    return TextAction, TextObservation


def build_app(env: Env, max_sessions: int = 256):
    """An OpenEnv FastAPI app serving ``env``: each session plays its own deep copy of it."""
    from openenv.core.env_server.http_server import create_app
    from openenv.core.env_server.interfaces import Environment
    from openenv.core.env_server.types import EnvironmentMetadata, State

    TextAction, TextObservation = _wire_models()

    class RagenEnvironment(Environment):
        SUPPORTS_CONCURRENT_SESSIONS = True

        def __init__(self) -> None:
            super().__init__()
            self.env = copy.deepcopy(env)
            self._state = State(episode_id=None, step_count=0)

        def _observation(self, text: str, reward: float, done: bool, info: dict[str, Any]) -> Any:
            return TextObservation(
                text=text, reward=reward, done=done, instructions=self.env.instructions,
                actions=list(self.env.actions) if self.env.actions is not None else None,
                success=bool(info.get("success", False)), action_is_valid=bool(info.get("action_is_valid", True)),
                action_is_effective=bool(info.get("action_is_effective", False)),
                state_id=anchor_state(self.env, text))

        def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> Any:
            text = self.env.reset(0 if seed is None else int(seed))
            self._state = State(episode_id=episode_id or str(uuid.uuid4()), step_count=0)
            return self._observation(text, 0.0, False, {})

        def step(self, action: Any, timeout_s: float | None = None, **kwargs: Any) -> Any:
            text, reward, done, info = self.env.step(action.action)
            self._state.step_count += 1
            return self._observation(text, float(reward), bool(done), info)

        @property
        def state(self) -> Any:
            return self._state

        def get_metadata(self) -> Any:
            from ragen_pl import __version__

            return EnvironmentMetadata(name=env.tag, description=f"ragen-pl's {type(env).__name__} "
                                       f"({type(env).__module__}), served by ragen-pl {__version__}",
                                       version=__version__)

    return create_app(RagenEnvironment, TextAction, TextObservation, env_name=env.tag,
                      max_concurrent_envs=max_sessions)


def serve(env: Env, host: str = "127.0.0.1", port: int = 8000, max_sessions: int = 256) -> None:
    """Serve ``env`` as an OpenEnv server until stopped (uvicorn)."""
    import uvicorn

    app = build_app(env, max_sessions)
    print(f"serving {env.tag} ({type(env).__name__}) as an OpenEnv server on ws://{host}:{port}/ws, up to "
          f"{max_sessions} sessions", flush=True)
    uvicorn.run(app, host=host, port=port, log_level="warning")


@contextlib.contextmanager
def served(env: str, env_args: dict[str, Any] | None = None, max_sessions: int = 256,
           wait_s: float = 90.0) -> Iterator[tuple[str, subprocess.Popen]]:
    """``ragen-pl serve`` in its own process on a free port of 127.0.0.1: yields ``(base_url, process)`` once the
    server answers ``/health``, and stops it on leaving. A server that exits first, or does not answer within
    ``wait_s``, raises RuntimeError with what it printed."""
    from ragen_pl.servers import local_server

    def command(port: int) -> list[str]:
        return [sys.executable, "-m", "ragen_pl.cli", "serve", "--env", env, "--env-args", json.dumps(env_args or {}),
                "--port", str(port), "--max-sessions", str(max_sessions)]

    with local_server(command, "/health", f"`ragen-pl serve --env {env}`", wait_s=wait_s) as served:
        yield served


# ---------------------------------------------------------------------------------------------- playing
class OpenEnvClient(Env):
    """An env played on an OpenEnv server, one WebSocket session per trajectory (see the module docstring)."""

    def __init__(
        self,
        base_url: str,
        timeout_s: float = 30.0,
        retries: int = 2,
        action_field: str = "action",
        observation_field: str = "text",
        instructions: str | None = None,
        actions: Sequence[str] | None = None,
        tag: str | None = None,
    ) -> None:
        """
        Args:
            base_url: the server's address, ``http://host:port`` (or ``ws://``).
            timeout_s: the longest wait for one reply (and for opening a session).
            retries: how often opening a session and the reset are tried again after a failure.
            action_field: the action model's text field (``action`` on ragen-pl's servers).
            observation_field: the observation's text field (``text`` on ragen-pl's servers).
            instructions: the rules shown once in the prompt; None takes the server's (its observations'
                ``instructions``), else a generic line.
            actions: the action names; None takes the server's (its observations' ``actions``), else free text.
            tag: metrics tag (default: the server's env name, else ``OpenEnv``).
        """
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://", "ws://", "wss://")):
            raise ValueError(f"`--data.env.init_args.base_url` must be an http(s):// or ws(s):// address, got "
                             f"{base_url!r}")
        if not timeout_s > 0:
            raise ValueError(f"`--data.env.init_args.timeout_s` must be > 0, got {timeout_s!r}")
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise ValueError(f"`--data.env.init_args.retries` must be an integer >= 0, got {retries!r}")
        self.base_url = base_url.rstrip("/")
        http = self.base_url.replace("ws://", "http://", 1).replace("wss://", "https://", 1)
        self.url = http.replace("http://", "ws://", 1).replace("https://", "wss://", 1) + "/ws"
        self.timeout_s, self.retries = float(timeout_s), retries
        self.action_field, self.observation_field = action_field, observation_field
        self._ws: Any = None
        self._session: contextlib.ExitStack | None = None
        self._seed: int | None = None
        self._last: dict[str, Any] = {}
        # One probe episode: a clear error now if the server is not there, and its rules and action names.
        try:
            first = self._reset(0)
        except OpenEnvError as err:
            raise ValueError(f"`--data.env.init_args.base_url`: {err}") from None
        finally:
            self.close()
        observation = first.get("observation", {})
        if observation_field not in observation:
            raise ValueError(f"`--data.env.init_args.observation_field`: the server at {self.base_url} sends "
                             f"observations with {sorted(observation)}, not {observation_field!r}")
        self._instructions = instructions or observation.get("instructions") or (
            f"You act in the environment served at {self.base_url}.")
        names = actions if actions is not None else observation.get("actions")
        self.actions = tuple(names) if names else None
        super().__init__(tag or _server_name(http, self.timeout_s) or "OpenEnv")

    # ----------------------------------------------------------- the session
    def _open(self) -> None:
        from websockets.sync.client import connect

        self._session = contextlib.ExitStack()
        self._ws = self._session.enter_context(connect(self.url, open_timeout=self.timeout_s, max_size=2**24,
                                                       proxy=None))

    def _ask(self, message: dict[str, Any]) -> dict[str, Any]:
        self._ws.send(json.dumps(message))
        reply = json.loads(self._ws.recv(timeout=self.timeout_s))
        if reply.get("type") == "error":
            raise OpenEnvError(f"the server answered an error: {reply.get('data', {}).get('message', reply)}")
        return reply.get("data", {})

    def _where(self) -> str:
        return f"OpenEnv server {self.base_url} (episode seed {self._seed})"

    def _reset(self, seed: int) -> dict[str, Any]:
        self._seed = seed
        for attempt in range(self.retries + 1):
            try:
                self.close()
                self._open()
                self._last = self._ask({"type": "reset", "data": {"seed": seed}})
                return self._last
            except Exception as err:  # noqa: BLE001 - retried, then one error naming the server and seed
                if attempt == self.retries:
                    raise OpenEnvError(f"{self._where()}: reset failed after {self.retries + 1} tries: "
                                       f"{type(err).__name__}: {err}") from err
                time.sleep(0.5 * 2**attempt)
        raise AssertionError("unreachable")

    def close(self) -> None:
        """End the session (the collector calls this when the trajectory ends)."""
        ws, self._ws = self._ws, None
        if ws is not None:
            try:  # ask the server to end the session, then wait for it to close the connection
                ws.send(json.dumps({"type": "close"}))
                ws.recv(timeout=self.timeout_s)
            except Exception:  # noqa: BLE001 - closed (as asked), or gone already
                pass
            self._session.close()

    def __deepcopy__(self, memo: dict) -> OpenEnvClient:
        """A copy without the session: each trajectory opens its own."""
        fresh = copy.copy(self)
        fresh._ws, fresh._session, fresh._last, fresh._seed = None, None, {}, None
        return fresh

    # ----------------------------------------------------------- Env
    @property
    def instructions(self) -> str:
        return self._instructions

    def reset(self, seed: int) -> str:
        self._reset(seed)
        return self.render()

    def render(self) -> str:
        return str(self._last.get("observation", {}).get(self.observation_field, ""))

    def state_key(self) -> Hashable | None:
        return self._last.get("observation", {}).get("state_id")

    def step(self, action: str) -> StepResult:
        if self._ws is None:
            raise OpenEnvError(f"{self._where()}: step before reset (or after the session ended)")
        try:
            self._last = self._ask({"type": "step", "data": {self.action_field: action}})
        except Exception as err:
            self.close()
            raise OpenEnvError(f"{self._where()}: step failed (a step is not retried): {type(err).__name__}: "
                               f"{err}") from err
        observation = self._last.get("observation", {})
        reward, done = float(self._last.get("reward") or 0.0), bool(self._last.get("done"))
        info = {"success": bool(observation.get("success", False)),
                "action_is_valid": bool(observation.get("action_is_valid", True)),
                "action_is_effective": bool(observation.get("action_is_effective", True))}
        if done:
            self.close()
        return self.render(), reward, done, info


def _server_name(http_url: str, timeout_s: float) -> str | None:
    """The env name the server reports on ``/metadata``, if it does."""
    import urllib.request

    try:
        with urllib.request.urlopen(f"{http_url}/metadata", timeout=timeout_s) as r:
            name = json.loads(r.read()).get("name")
    except Exception:  # noqa: BLE001 - the name is a nicety
        return None
    return name if isinstance(name, str) and name else None
