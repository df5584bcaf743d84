"""``make image``: the server and operator images, built with buildah on whatever machine runs it.

- The base is each Dockerfile's default (``ARG BASE``) when podman has it or can pull it. Where no
  registry answers, a stand-in of the same Debian release is made with mmdebstrap, slimmed as the
  official ``-slim`` images are, from a tarball cached under ``build/images/``.
- pip inside the build uses this machine's settings (``pip config list``), carried in as build
  secrets only: a pip.conf and the CA bundle it names. The local folders and ``file://`` indexes it
  names are served read-only on loopback while the build runs (buildah binds only from the build
  context, and a ``-v`` volume leaves its mount point in every stage).
- torch's own index (``ARG TORCH_INDEX``) is used when it answers; otherwise pip's settings must
  provide torch's local build (here: the CPU wheel in the find-links folder).

``python -m images.build [server] [operator] [--torch-build cu130]``; docs/images.md explains.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import functools
import http.server
import re
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "build" / "images"
MOUNTS = "/tmp"  # where the Dockerfiles mount pip's secrets: in every base, so no mount point is left


@dataclass(frozen=True)
class Image:
    dockerfile: str
    tag: str


IMAGES = {
    "server": Image("Dockerfile.server", "localhost/kembed-server:dev"),
    "operator": Image("Dockerfile.operator", "localhost/kembed-operator:dev"),
}


def build_args(dockerfile: str) -> dict[str, str]:
    """The Dockerfile's ``ARG NAME=default`` lines (before and between stages)."""
    text = (ROOT / dockerfile).read_text()
    return dict(re.findall(r"^ARG (\w+)=(\S+)$", text, re.M))


# --- the base ---------------------------------------------------------------------------------------


def podman(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["podman", *args], capture_output=True, text=True, check=check)


@functools.cache
def base_image(default: str) -> str:
    """``default`` when podman has it or can pull it, else the mmdebstrap stand-in's name."""
    if podman("image", "exists", default, check=False).returncode == 0:
        return default
    pulled = podman("pull", "--quiet", default, check=False)
    if pulled.returncode == 0:
        return default
    print(f"images: cannot pull {default} ({pulled.stderr.strip().splitlines()[-1]}): a stand-in", flush=True)
    return stand_in(default)


def stand_in(default: str) -> str:
    """A Debian base of ``default``'s release made by mmdebstrap, imported into podman once."""
    match = re.fullmatch(r"(?:docker\.io/)?(?:library/)?debian:(\w+)-slim", default)
    if match is None:
        raise SystemExit(f"images: no stand-in for {default}: make one and pass BASE=...")
    suite = match.group(1)
    name = f"localhost/kembed-base:{suite}-slim"
    tarball = WORK / f"debian-{suite}-slim.tar"
    if not tarball.exists():
        _mmdebstrap(suite, tarball)
        podman("rmi", "--ignore", name)
    if podman("image", "exists", name, check=False).returncode != 0:
        podman("import", "--quiet", str(tarball), name)
    return name


# What the official -slim images leave out, and how their apt keeps no caches (debuerreotype's
# --slim and docker-clean), so the stand-in weighs what the real base weighs.
SLIM_EXCLUDES = ["/usr/share/doc/*", "/usr/share/info/*", "/usr/share/man/*", "/usr/share/groff/*"]
SLIM_EXCLUDES += ["/usr/share/linda/*", "/usr/share/lintian/*", "/usr/share/locale/*"]
CLEAN = "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"
APT_OPTIONS = ['Dir::Cache::pkgcache ""', 'Dir::Cache::srcpkgcache ""', 'Acquire::Languages "none"']
APT_OPTIONS += [f'DPkg::Post-Invoke {{ "{CLEAN}"; }}', f'APT::Update::Post-Invoke {{ "{CLEAN}"; }}']
APT_OPTIONS += ['APT::Install-Recommends "false"']


def _mmdebstrap(suite: str, tarball: Path) -> None:
    if shutil.which("mmdebstrap") is None:
        raise SystemExit("images: no base can be pulled and mmdebstrap is missing (apt-get install mmdebstrap)")
    mirror = "http://deb.debian.org"
    sources = [f"deb {mirror}/debian {suite} main", f"deb {mirror}/debian {suite}-updates main"]
    sources.append(f"deb {mirror}/debian-security {suite}-security main")
    options = [f"--dpkgopt=path-exclude={path}" for path in SLIM_EXCLUDES]
    options.append("--dpkgopt=path-include=/usr/share/doc/*/copyright")
    options += [f"--aptopt={option}" for option in APT_OPTIONS]
    # /usr merged before anything is installed, as in the official images (no usrmerge, no perl).
    options.append("--hook-dir=/usr/share/mmdebstrap/hooks/merged-usr")
    tarball.parent.mkdir(parents=True, exist_ok=True)
    partial = tarball.with_suffix(".partial.tar")
    started = time.monotonic()
    run(["mmdebstrap", "--quiet", "--variant=minbase", *options, suite, str(partial), *sources])
    partial.rename(tarball)
    print(f"images: {tarball.name} made in {time.monotonic() - started:.0f} s", flush=True)


# --- pip's settings -----------------------------------------------------------------------------------

FILE_KEYS = {"cert"}  # read by pip as a local file: carried as the secret "pip-cert"
LOCATION_KEYS = {"find-links", "index-url", "extra-index-url", "constraint", "requirement"}
CERT_SECRET = "pip-cert"
CONF_SECRET = "pip.conf"


def pip_settings() -> dict[str, dict[str, str]]:
    """pip's effective settings by section, as ``pip config list`` shows them (environment last,
    since it overrides the files)."""
    listed = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True
    ).stdout
    sections: dict[str, dict[str, str]] = {}
    env: dict[str, str] = {}
    for line in listed.splitlines():
        name, _, value = line.partition("=")
        scope, _, key = name.rpartition(".")
        if scope == ":env:":
            env[key] = ast.literal_eval(value)
        else:
            sections.setdefault(scope, {})[key] = ast.literal_eval(value)
    sections.setdefault("global", {}).update(env)
    return sections


def carry(settings: dict[str, dict[str, str]], url: str, served: dict[str, Path]) -> tuple[str, dict[str, Path]]:
    """``settings`` rewritten for a build, as pip.conf text, and the files to pass as secrets: the CA
    bundle becomes a secret, local locations URLs below ``url``, whose folders go into ``served``."""
    secrets: dict[str, Path] = {}
    carried: dict[str, dict[str, str]] = {}
    for section, values in settings.items():
        for key, value in values.items():
            if key in FILE_KEYS:
                secrets[CERT_SECRET] = Path(value)
                value = f"{MOUNTS}/{CERT_SECRET}"
            elif key in LOCATION_KEYS:
                value = " ".join(_served(item, key, url, served) for item in value.split())
            carried.setdefault(section, {})[key] = value
    if served:
        carried.setdefault("global", {})["trusted-host"] = str(urllib.parse.urlsplit(url).hostname)
    text = "".join(
        f"[{section}]\n" + "".join(f"{key} = {value}\n" for key, value in values.items())
        for section, values in carried.items()
    )
    return text, secrets


def _served(location: str, key: str, url: str, served: dict[str, Path]) -> str:
    """``location`` as the build reaches it: remote URLs as they are, local paths through the server.
    An index's pages link to files beside it (``../../files/``), so an index is served from its parent;
    a file (a constraints file) is served alone."""
    parsed = urllib.parse.urlsplit(location)
    if parsed.scheme not in ("", "file"):
        return location
    path = Path(urllib.parse.unquote(parsed.path)).resolve()
    root = path.parent if key.endswith("index-url") else path
    prefix = str(len(served))
    served[prefix] = root
    if path.is_file():
        return f"{url}/{prefix}/{path.name}"
    tail = "" if path == root else f"/{path.relative_to(root)}"
    return f"{url}/{prefix}{tail}/"


class _Handler(http.server.SimpleHTTPRequestHandler):
    """GET and HEAD of what lies below the served folders, and only of what anyone here may read."""

    roots: dict[str, Path]

    def translate_path(self, path: str) -> str:
        """``/PREFIX/REST`` -> the file REST below the folder served as PREFIX; "" (404) for anything else."""
        prefix, _, rest = urllib.parse.unquote(urllib.parse.urlsplit(path).path).lstrip("/").partition("/")
        root = self.roots.get(prefix)
        if root is None or (root.is_file() and rest != root.name):
            return ""
        target = (root / rest).resolve() if root.is_dir() else root
        if not target.is_relative_to(root) or (target.exists() and not target.stat().st_mode & stat.S_IROTH):
            return ""
        return str(target)

    def log_message(self, format: str, *args: object) -> None:  # pip's own log says enough
        pass


@contextlib.contextmanager
def serving() -> Iterator[tuple[str, dict[str, Path]]]:
    """A loopback file server while the build runs: its URL, and the folders it serves (filled later)."""
    roots: dict[str, Path] = {}
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), type("Handler", (_Handler,), {"roots": roots}))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}", roots
    finally:
        server.shutdown()
        server.server_close()


# --- building ------------------------------------------------------------------------------------------


def reachable(url: str) -> bool:
    parsed = urllib.parse.urlsplit(url)
    try:
        with socket.create_connection((parsed.hostname or "", parsed.port or 443), timeout=5):
            return True
    except OSError:
        return False


def run(command: list[str]) -> None:
    done = subprocess.run(command)
    if done.returncode:
        raise SystemExit(f"images: {' '.join(command[:2])} failed ({done.returncode})")


def build(name: str, torch_build: str) -> float:
    """Build one image; the seconds it took."""
    image = IMAGES[name]
    defaults = build_args(image.dockerfile)
    args = {"BASE": base_image(defaults["BASE"])}
    if "TORCH_BUILD" in defaults:
        args["TORCH_BUILD"] = torch_build
        index = defaults["TORCH_INDEX"].replace("${TORCH_BUILD}", torch_build)
        if not reachable(index):
            print(f"images: {index} does not answer: torch must come from pip's own settings", flush=True)
            args["TORCH_INDEX"] = ""
    command = ["buildah", "bud", "--isolation", "chroot", "--format", "docker", "--layers", "--jobs", "2"]
    command += [f"--build-arg={key}={value}" for key, value in args.items()]
    command += ["-f", str(ROOT / image.dockerfile), "-t", image.tag]
    started = time.monotonic()
    # The pip.conf lives as long as the build: the secret's source, nowhere else.
    with serving() as (url, served), tempfile.TemporaryDirectory(prefix="kembed-pip-") as folder:
        text, secrets = carry(pip_settings(), url, served)
        conf = Path(folder) / CONF_SECRET
        conf.write_text(text)
        secrets[CONF_SECRET] = conf
        run([*command, *(f"--secret=id={key},src={path}" for key, path in secrets.items()), str(ROOT)])
    return time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser(description="Build kembed's images with buildah (docs/images.md).")
    parser.add_argument("images", nargs="*", help=f"any of {', '.join(IMAGES)} (default: all)")
    parser.add_argument("--torch-build", default="cpu", help="the server's torch build: cpu or cu130")
    args = parser.parse_args()
    if unknown := set(args.images) - set(IMAGES):
        parser.error(f"no such image: {', '.join(sorted(unknown))}")
    if shutil.which("buildah") is None:
        raise SystemExit("images: buildah is missing (apt-get install podman buildah runc mmdebstrap)")
    for name in args.images or IMAGES:
        seconds = build(name, args.torch_build)
        size = int(podman("image", "inspect", "--format", "{{.Size}}", IMAGES[name].tag).stdout)
        print(f"images: {IMAGES[name].tag} built in {seconds:.0f} s, {size / 1e6:.0f} MB", flush=True)


if __name__ == "__main__":
    main()
