"""Image digests from an OCI distribution registry (the /v2/ API), without a container engine.

`resolve_tag` follows a tag to the manifest digest the registry serves for it (HEAD first, GET and hash the body
when a registry omits Docker-Content-Digest); `require_digest` checks that a pinned digest still exists. Anonymous
bearer tokens (Docker Hub, ghcr.io) are fetched from the realm the registry names in its 401 challenge.

Tests and air-gapped mirrors point every reference at one registry base URL (`registry_url`, or the
B70CTL_REGISTRY_URL environment variable): the reference's own host is then ignored.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass

import httpx

from b70ctl.errors import BadInput, Unreachable

REGISTRY_URL_ENV = "B70CTL_REGISTRY_URL"
DOCKER_HUB_REGISTRY = "registry-1.docker.io"
# Indexes first: a multi-arch tag must resolve to its index digest, the pin `docker pull name@digest` expects.
MANIFEST_ACCEPT = ", ".join([
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
])
DIGEST_PATTERN = re.compile(r"^sha256:[0-9a-f]{64}$")


@dataclass(frozen=True)
class ImageReference:
    registry: str
    repository: str
    tag: str | None
    digest: str | None

    def __str__(self) -> str:
        host = "" if self.registry == DOCKER_HUB_REGISTRY else self.registry + "/"
        name = self.repository.removeprefix("library/") if not host else self.repository
        return f"{host}{name}" + (f":{self.tag}" if self.tag else "") + (f"@{self.digest}" if self.digest else "")


def parse_reference(reference: str, tag: str | None = None) -> ImageReference:
    """Split `[registry/]repository[:tag][@digest]` the way docker does: the first component is a registry only
    when it has a dot or a port or is localhost; bare Docker Hub names get `library/`."""
    rest, _, digest = reference.partition("@")
    if digest and not DIGEST_PATTERN.match(digest):
        raise BadInput(f"image reference {reference!r}: {digest!r} is not a sha256 digest")
    last_slash = rest.rfind("/")
    if ":" in rest[last_slash + 1:]:
        rest, _, own_tag = rest.rpartition(":")
        tag = tag or own_tag
    first, _, remainder = rest.partition("/")
    if remainder and ("." in first or ":" in first or first == "localhost"):
        registry, repository = first, remainder
    else:
        registry, repository = DOCKER_HUB_REGISTRY, rest
        if "/" not in repository:
            repository = "library/" + repository
    return ImageReference(registry=registry, repository=repository, tag=tag, digest=digest or None)


def _base_url(reference: ImageReference, registry_url: str | None) -> str:
    override = registry_url or os.environ.get(REGISTRY_URL_ENV)
    if override:
        return override.rstrip("/")
    scheme = "http" if reference.registry.startswith(("localhost", "127.0.0.1")) else "https"
    return f"{scheme}://{reference.registry}"


def _bearer_token(client: httpx.Client, challenge: str, repository: str) -> str | None:
    """Anonymous pull token from the realm in `WWW-Authenticate: Bearer realm=...,service=...`."""
    if not challenge.lower().startswith("bearer "):
        return None
    fields = dict(re.findall(r'(\w+)="([^"]*)"', challenge))
    if "realm" not in fields:
        return None
    params = {"scope": f"repository:{repository}:pull"}
    if "service" in fields:
        params["service"] = fields["service"]
    response = client.get(fields["realm"], params=params)
    if response.status_code != 200:
        return None
    body = response.json()
    token = body.get("token") or body.get("access_token")
    return token if isinstance(token, str) else None


def _manifest_request(reference: ImageReference, ref: str, registry_url: str | None,
                      timeout_s: float) -> tuple[int, str | None]:
    """HEAD (then GET if needed) /v2/NAME/manifests/REF -> (status, digest or None)."""
    url = f"{_base_url(reference, registry_url)}/v2/{reference.repository}/manifests/{ref}"
    headers = {"Accept": MANIFEST_ACCEPT}
    try:
        with httpx.Client(timeout=timeout_s, follow_redirects=True) as client:
            response = client.head(url, headers=headers)
            if response.status_code == 401:
                token = _bearer_token(client, response.headers.get("WWW-Authenticate", ""), reference.repository)
                if token:
                    headers["Authorization"] = f"Bearer {token}"
                    response = client.head(url, headers=headers)
            if response.status_code != 200:
                return response.status_code, None
            digest = response.headers.get("Docker-Content-Digest")
            if digest is None:
                # Some registries omit the header on HEAD: the digest is by definition the sha256 of the body.
                body = client.get(url, headers=headers)
                if body.status_code != 200:
                    return body.status_code, None
                digest = body.headers.get("Docker-Content-Digest") or (
                    "sha256:" + hashlib.sha256(body.content).hexdigest())
            return 200, digest
    except httpx.HTTPError as error:
        raise Unreachable(f"registry for {reference} is unreachable at {url} ({error.__class__.__name__}): "
                       f"run where the registry is reachable, or set {REGISTRY_URL_ENV} to a mirror") from error


def resolve_tag(image: str, tag: str | None = None, registry_url: str | None = None,
                timeout_s: float = 30.0) -> str:
    """The manifest digest the registry serves for image:tag now (this is what follows a moving tag)."""
    reference = parse_reference(image, tag)
    if reference.digest:
        require_digest(image, reference.digest, registry_url, timeout_s)
        return reference.digest
    if not reference.tag:
        raise BadInput(f"image {image!r} names no tag to resolve: give the tag to follow (name:tag) or a digest")
    status, digest = _manifest_request(reference, reference.tag, registry_url, timeout_s)
    if status == 404:
        raise BadInput(f"image {reference} does not exist in its registry: check the repository and tag")
    if status != 200 or digest is None:
        raise BadInput(f"registry answered HTTP {status} for {reference}: check access to the repository")
    if not DIGEST_PATTERN.match(digest):
        raise BadInput(f"registry gave {digest!r} for {reference}, not a sha256 digest")
    return digest


def require_digest(image: str, digest: str, registry_url: str | None = None, timeout_s: float = 30.0) -> None:
    """Fail, naming the digest, when the registry no longer has the pinned manifest."""
    reference = parse_reference(image)
    reference = ImageReference(reference.registry, reference.repository, None, digest)
    status, found = _manifest_request(reference, digest, registry_url, timeout_s)
    if status == 404:
        raise BadInput(f"image digest {digest} does not exist in {reference.registry}/{reference.repository}: "
                       "the pinned image is gone; re-resolve the lock (b70ctl lock resolve) or build the image")
    if status != 200:
        raise BadInput(f"registry answered HTTP {status} for {reference}: check access to the repository")
    if found != digest:
        raise BadInput(f"registry served {found} when asked for {digest} ({reference.repository}): "
                       "the registry is not content-addressed correctly; use another mirror")
