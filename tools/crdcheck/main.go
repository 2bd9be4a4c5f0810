// crdcheck runs the apiserver's own CustomResourceDefinition checks offline, with the Kubernetes
// libraries the local cluster is built from (v0.36.x), so unit tests can prove without a cluster
// that the generated CRD installs (structural schema, CEL compiles, CEL cost within limits) and that
// each invalid TPUFineTune is rejected with the expected message.
//
//	crdcheck CRD.yaml                 validate the CRD; prints a JSON list of errors
//	crdcheck CRD.yaml CASES.yaml      also admit each case; prints {"crd": [...], "cases": {name: [...]}}
//
// CASES.yaml is a list of {name, object, old?}: with `old` the case is an update (transition rules
// run), without it a create. Steps per object follow the apiserver: prune unknown fields (reported,
// as kubectl's strict field validation does), apply defaults, validate the schema, run CEL.
package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"

	apiextensions "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions"
	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	crdvalidation "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/validation"
	structuralschema "k8s.io/apiextensions-apiserver/pkg/apiserver/schema"
	"k8s.io/apiextensions-apiserver/pkg/apiserver/schema/cel"
	structuraldefaulting "k8s.io/apiextensions-apiserver/pkg/apiserver/schema/defaulting"
	structuralpruning "k8s.io/apiextensions-apiserver/pkg/apiserver/schema/pruning"
	apiservervalidation "k8s.io/apiextensions-apiserver/pkg/apiserver/validation"
	"k8s.io/apimachinery/pkg/runtime"
	utiljson "k8s.io/apimachinery/pkg/util/json"
	"k8s.io/apimachinery/pkg/util/validation/field"
	celconfig "k8s.io/apiserver/pkg/apis/cel"
	"sigs.k8s.io/yaml"
)

type testCase struct {
	Name   string                 `json:"name"`
	Object map[string]interface{} `json:"object"`
	Old    map[string]interface{} `json:"old,omitempty"`
}

func must(err error) {
	if err != nil {
		fmt.Fprintln(os.Stderr, "crdcheck:", err)
		os.Exit(2)
	}
}

func messages(errs field.ErrorList) []string {
	out := []string{}
	for _, e := range errs {
		out = append(out, e.Error())
	}
	return out
}

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: crdcheck CRD.yaml [CASES.yaml]")
		os.Exit(2)
	}
	data, err := os.ReadFile(os.Args[1])
	must(err)
	var v1crd apiextensionsv1.CustomResourceDefinition
	must(yaml.UnmarshalStrict(data, &v1crd))
	scheme := runtime.NewScheme()
	must(apiextensionsv1.AddToScheme(scheme))
	must(apiextensions.AddToScheme(scheme))
	var crd apiextensions.CustomResourceDefinition
	must(scheme.Convert(&v1crd, &crd, nil))
	crd.Status.StoredVersions = []string{crd.Spec.Versions[0].Name}
	crdErrs := messages(crdvalidation.ValidateCustomResourceDefinition(context.Background(), &crd))
	if len(os.Args) < 3 {
		out, _ := json.Marshal(crdErrs)
		fmt.Println(string(out))
		if len(crdErrs) > 0 {
			os.Exit(1)
		}
		return
	}

	// The internal type keeps a schema shared by every version at the top level.
	var props *apiextensions.JSONSchemaProps
	if crd.Spec.Validation != nil {
		props = crd.Spec.Validation.OpenAPIV3Schema
	} else {
		props = crd.Spec.Versions[0].Schema.OpenAPIV3Schema
	}
	structural, err := structuralschema.NewStructural(props)
	must(err)
	validator, _, err := apiservervalidation.NewSchemaValidator(props)
	must(err)
	celValidator := cel.NewValidator(structural, true, celconfig.PerCallLimit)

	casesData, err := os.ReadFile(os.Args[2])
	must(err)
	// Decode as the apiserver does: integral JSON numbers become int64, not float64.
	casesJSON, err := yaml.YAMLToJSON(casesData)
	must(err)
	var cases []testCase
	must(utiljson.Unmarshal(casesJSON, &cases))

	results := map[string][]string{}
	for _, c := range cases {
		var errs field.ErrorList
		admit := func(obj map[string]interface{}) {
			pruned := structuralpruning.PruneWithOptions(obj, structural, true, structuralschema.UnknownFieldPathOptions{TrackUnknownFieldPaths: true})
			for _, p := range pruned {
				errs = append(errs, field.Invalid(field.NewPath(p), nil, "unknown field"))
			}
			structuraldefaulting.Default(obj, structural)
		}
		admit(c.Object)
		var oldObj interface{}
		if c.Old != nil {
			admit(c.Old)
			oldObj = c.Old
			errs = append(errs, apiservervalidation.ValidateCustomResourceUpdate(nil, c.Object, c.Old, validator)...)
		} else {
			errs = append(errs, apiservervalidation.ValidateCustomResource(nil, c.Object, validator)...)
		}
		celErrs, _ := celValidator.Validate(context.Background(), nil, structural, c.Object, oldObj, celconfig.RuntimeCELCostBudget)
		errs = append(errs, celErrs...)
		results[c.Name] = messages(errs)
	}
	out, _ := json.MarshalIndent(map[string]interface{}{"crd": crdErrs, "cases": results}, "", "  ")
	fmt.Println(string(out))
}
