# Deployment targets and the tools their checks need (see README "Deploy").
.PHONY: deploy-tools
deploy-tools:
