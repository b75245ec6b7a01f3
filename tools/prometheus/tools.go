//go:build tools

// Package tools pins Prometheus, built with Kubernetes service discovery only
// (Debian's package has none), so the tests discover pods as a cluster's
// Prometheus would.
package tools

import _ "github.com/prometheus/prometheus/cmd/prometheus"
