//go:build tools

// Package tools pins helm, used to lint and render the chart in tests.
package tools

import _ "helm.sh/helm/v3/cmd/helm"
