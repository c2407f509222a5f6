"""tokenline on Ray Serve: the OpenAI ingress, the engine replicas and the app builder (`deployments.app:build_app`)."""
