#!/usr/bin/env python3
"""The Debian packages that hold the shared libraries a binary links on this machine, with the
upstream version installed here (the epoch kept): what the .deb depends on (at least that
version: a binary built against a newer glibc or OpenSSL needs it) and what the image is made of.

    packaging/linked_packages.py BINARY...    # prints "PACKAGE VERSION" lines

Found with objdump (the NEEDED entries), ldconfig (where each library is) and dpkg -S (its
package): libssl3 on Debian 12, libssl3t64 on a newer Debian.
"""

import os
import subprocess
import sys


class Missing(Exception):
    """A library or its package not found, with the reason."""


def output(*argv):
    try:
        return subprocess.run(argv, check=True, capture_output=True, text=True).stdout
    except FileNotFoundError:
        raise Missing(f"{argv[0]} is not installed") from None
    except subprocess.CalledProcessError as e:
        raise Missing(f"{' '.join(argv)} failed: {e.stderr.strip()}") from None


def needed(binary):
    """The shared libraries a binary links (its NEEDED entries)."""
    return [l.split()[-1] for l in output("objdump", "-p", binary).splitlines() if l.strip().startswith("NEEDED")]


def linked_packages(binaries):
    """[(package, version)] for the libraries the binaries link, in the order first linked."""
    cache = output("ldconfig", "-p")
    found = []
    for binary in binaries:
        for lib in needed(binary):
            paths = [line.split("=>")[-1].strip() for line in cache.splitlines() if line.strip().startswith(lib + " ")]
            if not paths:
                raise Missing(f"{binary} links {lib}, which this machine does not have")
            owner = subprocess.run(["dpkg", "-S", os.path.realpath(paths[0])], capture_output=True, text=True)
            if owner.returncode != 0:
                owner = subprocess.run(["dpkg", "-S", paths[0]], capture_output=True, text=True)
            if owner.returncode != 0:
                raise Missing(f"no Debian package holds {paths[0]} ({lib})")
            package = owner.stdout.split(":")[0].strip()
            if package not in [p for p, _ in found]:
                version = output("dpkg-query", "-W", "-f=${Version}", package)
                found.append((package, version.rsplit("-", 1)[0]))
    return found


if __name__ == "__main__":
    try:
        for package, version in linked_packages(sys.argv[1:]):
            print(package, version)
    except Missing as e:
        print(f"packaging/linked_packages.py: {e}", file=sys.stderr)
        sys.exit(1)
