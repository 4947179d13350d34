"""Stage 5, serving: the running deployment (:mod:`.deployment`: engines through a backend, one sglang-router per
model, readiness, registration, teardown), the routers' HTTP side (:mod:`.routers`, :mod:`.router_main`) and
the registry rollout code asks for URLs (:mod:`.registry`)."""
