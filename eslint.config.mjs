// Lint of the JupyterLab extension (src/) and its unit tests (test/unit/): ESLint's and
// typescript-eslint's recommended rules; the layout is prettier's (`npm run lint`).
import js from '@eslint/js';
import tseslint from 'typescript-eslint';

export default tseslint.config(
  { ignores: ['lib/', 'build/', 'provisioner/', 'node_modules/', '.venv/'] },
  {
    files: ['src/**/*.ts', 'test/**/*.ts'],
    extends: [js.configs.recommended, ...tseslint.configs.recommended],
    rules: {
      eqeqeq: 'error',
      curly: 'error',
      '@typescript-eslint/no-unused-vars': ['error', { args: 'none' }]
    }
  }
);
