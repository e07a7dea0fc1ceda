// Unit tests of the JupyterLab extension's model and text (test/unit/*.spec.ts), compiled
// by ts-jest with tsconfig.test.json; run by `npm run test:unit` (and `make test`).
// @jupyterlab/translation ships ES modules only: ts-jest compiles it to CommonJS too.
const esm = ['@jupyterlab/translation'];

module.exports = {
  testEnvironment: 'node',
  roots: ['<rootDir>/test/unit'],
  testMatch: ['**/*.spec.ts'],
  transform: {
    '^.+\\.[jt]s$': ['ts-jest', { tsconfig: 'tsconfig.test.json' }]
  },
  transformIgnorePatterns: [`/node_modules/(?!(${esm.join('|')})/)`]
};
