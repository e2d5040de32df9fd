"""The operator's kits of a pilot federation: what the server side builds and sends out.

- ``provision``: one kit per site and one for the server (``fedpose provision``);
- ``certs``: the federation's CA and the server's TLS certificate (``fedpose certs``);
- ``templates``: the texts of the kits' files, which the deployment guide shows too;
- ``wheel``: the fedpose wheel and lock every kit installs from;
- ``register``: the sites' public keys registered with the SuperLink (``fedpose server register-sites``);
- ``bundle``: the Flower app and the bundle the sites approve (``fedpose server build-app``).

A site's own key pair is made at the site (``fedpose site keygen``): its key material lives in
``fedpose.shared.flower.node_keys``, which both sides use. Nothing here runs in a federation's apps.
"""
